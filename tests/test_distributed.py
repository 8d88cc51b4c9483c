"The user's accelerate settings, two machines, any world size: real `accelerate launch` processes on CPU (gloo)."
import csv, json, os, re, shutil, subprocess, sys
from pathlib import Path
import pytest
from dflash.bench.harness import launch_train
from conftest import override

# one worker runs this file's tests in order (pytest -n with --dist loadgroup): they share the module's runs
pytestmark = pytest.mark.xdist_group('distributed')

# a short run on the shipped toy target; checkpoints at step 2 and 4 so a run can be resumed from the middle
SMALL = ['--num-layers', '2', '--num-anchors', '16', '--max-length', '128', '--batch-size', '4',
         '--micro-batch-size', '1', '--lr', '3e-3', '--attention', 'eager', '--log-every', '1', '--eval-every', '0',
         '--spec-eval-prompts', '0', '--seed', '3', '--max-steps', '4', '--save-every', '2', '--keep-checkpoints', '3']
ENV = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONUNBUFFERED': '1', 'ACCELERATE_USE_CPU': 'true'}


def launch(out, *args, **kw) -> subprocess.CompletedProcess:
    r = launch_train(out, *args, timeout=900, **kw)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def losses(out) -> dict[int, float]:
    rows = csv.DictReader((Path(out) / 'metrics.csv').read_text().splitlines())
    return {int(r['step']): float(r['loss']) for r in rows}


def epochs(out) -> dict[int, str]:
    return {int(r['step']): r['epoch'] for r in csv.DictReader((Path(out) / 'metrics.csv').read_text().splitlines())}


def assert_close(a: dict, b: dict, tol: float = 1e-4):
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for k in a: assert abs(a[k] - b[k]) <= tol * max(1., abs(b[k])), (k, a[k], b[k])


def summary(out) -> dict: return json.loads((Path(out) / 'summary.json').read_text())


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    "The same 4-step run on 1 process and on 2 processes (one machine), checkpointed at steps 2 and 4."
    root = tmp_path_factory.mktemp('dist')
    launch(root / 'one', *SMALL)
    launch(root / 'two', *SMALL, processes=2)
    return root


def test_one_and_two_processes_agree(runs):
    assert_close(losses(runs / 'two'), losses(runs / 'one'))
    assert summary(runs / 'one')['metrics']['distributed_type'] == 'NO'
    assert summary(runs / 'two')['metrics']['distributed_type'] == 'MULTI_CPU'


def test_launch_mixed_precision_wins(runs, tmp_path):
    "`--mixed_precision bf16` on the launch line reaches the trainer: bf16 autocast on CPU, recorded in the summary."
    launch(tmp_path / 'bf16', *override(SMALL, '--attention', 'sdpa'), accelerate_args=('--mixed_precision', 'bf16'))
    assert summary(tmp_path / 'bf16')['metrics']['mixed_precision'] == 'bf16'
    assert summary(runs / 'one')['metrics']['mixed_precision'] == 'no'
    bf16, fp32 = losses(tmp_path / 'bf16'), losses(runs / 'one')
    assert bf16.keys() == fp32.keys()
    assert any(abs(bf16[k] - fp32[k]) > 1e-4 for k in bf16), "bf16 autocast changes the numbers"
    assert all(abs(bf16[k] - fp32[k]) < 0.05 * fp32[k] for k in bf16), (bf16, fp32)


def test_two_machines_on_localhost_equal_one_machine(runs, tmp_path):
    "2 machines x 1 process, started together, train the model that 1 machine x 2 processes trains."
    launch(tmp_path / 'nodes', *SMALL, processes=2, machines=2)           # one launch per machine, started together
    rows = list(csv.DictReader((tmp_path / 'nodes' / 'metrics.csv').read_text().splitlines()))
    assert [r['processes'] for r in rows] == ['2'] * 4, "one run of 2 processes, each step logged once"
    assert_close(losses(tmp_path / 'nodes'), losses(runs / 'two'))


def _interrupted_copy(src: Path, dst: Path) -> Path:
    "A run directory as `src` was after its step-2 checkpoint: that checkpoint only, nothing after it."
    (dst / 'checkpoints').mkdir(parents=True)
    shutil.copytree(src / 'checkpoints' / 'step-0000002', dst / 'checkpoints' / 'step-0000002')
    return dst


@pytest.mark.parametrize('saved,resumed', [(2, 1), (1, 2)])
def test_resume_with_another_world_size(runs, tmp_path, saved, resumed):
    "Checkpointed with `saved` processes, resumed with `resumed`: the same data order and losses as straight through."
    src = runs / {1: 'one', 2: 'two'}[saved]
    out = _interrupted_copy(src, tmp_path / 'resumed')
    r = launch(out, *SMALL, '--resume', processes=resumed)
    assert 'resumed from' in r.stdout + r.stderr
    after = losses(out)
    assert sorted(after) == [3, 4], "training went on from step 3"
    assert_close(after, {k: v for k, v in losses(src).items() if k > 2})
    assert epochs(out) == {k: v for k, v in epochs(src).items() if k > 2}
    assert summary(out)['metrics']['processes'] == resumed


def test_deepspeed_is_refused_before_loading(tmp_path):
    "Under DeepSpeed (accelerate sets ACCELERATE_USE_DEEPSPEED for its processes) the trainer stops with a reason."
    r = subprocess.run([sys.executable, '-m', 'dflash.train', '--out', str(tmp_path / 'ds'), *SMALL],
                       env={**ENV, 'ACCELERATE_USE_DEEPSPEED': 'true'}, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert 'DeepSpeed is not supported by dflash.train' in r.stderr, r.stderr
    assert not (tmp_path / 'ds' / 'metrics.csv').exists()


FSDP = ('--mixed_precision', 'no', '--use_fsdp', '--fsdp_version', '2')


@pytest.fixture(scope='module')
def fsdp_run(runs):
    "The 2-process run under FSDP, every layer checkpointed (on CPU, where accelerate's plugin cannot start)."
    out = runs / 'fsdp'
    r = launch(out, *override(SMALL, '--checkpointing', 'all', '--spec-eval-prompts', '1', '--spec-new-tokens', '16'),
               processes=2, accelerate_args=FSDP)
    return out, r.stdout + r.stderr


def test_fsdp_shards_and_trains_like_ddp(runs, fsdp_run):
    "Sharded over 2 processes, the drafter follows DDP's loss curve, and exports and measures the same drafter."
    from safetensors.torch import load_file
    out, log = fsdp_run
    held, total = (int(n.replace(',', '')) for n in re.search(r'this one holds ([\d,]+) of its ([\d,]+) parameters',
                                                              log).groups())
    assert 0.4 * total < held < 0.6 * total, (held, total)
    assert 'layer checkpointing: all' in log
    assert_close(losses(out), losses(runs / 'two'))
    m = summary(out)['metrics']
    assert m['fsdp'] and m['distributed_type'] == 'MULTI_CPU' and m['processes'] == 2
    assert summary(out)['spec_after']['tau'] >= 1.0, "the whole drafter, gathered, drafts on the main process"
    a, b = load_file(out / 'drafter' / 'model.safetensors'), load_file(runs / 'two' / 'drafter' / 'model.safetensors')
    assert a.keys() == b.keys() and all((a[k] - b[k]).abs().max() < 1e-5 for k in a)


@pytest.mark.parametrize('saved,resumed', [('fsdp', 1), ('two', 'fsdp')])
def test_fsdp_checkpoints_resume_anywhere(runs, fsdp_run, tmp_path, saved, resumed):
    "A checkpoint holds whole tensors by name: FSDP's resumes on 1 process, and DDP's resumes under FSDP."
    out = _interrupted_copy(runs / saved, tmp_path / 'resumed')
    launch(out, *SMALL, '--resume', processes=2 if resumed == 'fsdp' else resumed,
           **({'accelerate_args': FSDP} if resumed == 'fsdp' else {}))
    assert_close(losses(out), {k: v for k, v in losses(runs / 'two').items() if k > 2})


def test_fsdp_settings_it_cannot_use_are_refused_before_loading(tmp_path):
    "FSDP1 and FSDP's own activation checkpointing: one error naming both, before any model loads."
    env = {**ENV, 'ACCELERATE_USE_FSDP': 'true', 'FSDP_VERSION': '1', 'FSDP_ACTIVATION_CHECKPOINTING': 'true'}
    r = subprocess.run([sys.executable, '-m', 'dflash.train', '--out', str(tmp_path / 'v1'), *SMALL],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    for says in ('fsdp_version 1', '--fsdp_version 2', 'fsdp_activation_checkpointing', '--checkpointing'):
        assert says in r.stderr, r.stderr
    assert 'Loading' not in r.stderr and not (tmp_path / 'v1' / 'metrics.csv').exists()
