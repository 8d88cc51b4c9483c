"The training CLI through real `accelerate launch` processes on CPU: 1 vs 2 processes, resume, bad runs."
import csv, json, os, re, signal, subprocess, sys, time
from pathlib import Path
import pytest
import torch
from dflash.bench.harness import launch_train
from conftest import override, train_cli

# a small, fast run on the shipped toy target: every option that matters is explicit
SMALL = ['--num-layers', '2', '--num-anchors', '16', '--max-length', '128', '--batch-size', '4',
         '--micro-batch-size', '1', '--lr', '3e-3', '--attention', 'eager', '--log-every', '1', '--eval-every', '0',
         '--eval-samples', '8', '--spec-eval-prompts', '0', '--seed', '3']


def launch(out, *args, processes=1, wait=True, env=None, module='dflash.train'):
    "`accelerate launch -m dflash.train` with `processes` CPU processes (and extra environment `env`)."
    return launch_train(out, *args, processes=processes, wait=wait, env=env, timeout=900, module=module)


def losses(out) -> dict[int, float]:
    "Training loss per step from metrics.csv (the last row wins when a resumed run re-logs a step)."
    rows = csv.DictReader((Path(out) / 'metrics.csv').read_text().splitlines())
    return {int(r['step']): float(r['loss']) for r in rows}


def held_out(run) -> dict[str, float]:
    "The first held-out evaluation a run logged."
    return {k: float(v) for k, v in next(csv.DictReader((run / 'eval.csv').read_text().splitlines())).items()}


def assert_close(a: dict, b: dict, rel: float):
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for k in a: assert abs(a[k] - b[k]) <= rel * abs(b[k]), (k, a[k], b[k])


def test_one_and_two_processes_train_the_same_model(tmp_path):
    one = launch(tmp_path / 'one', *SMALL, '--max-steps', '10', '--save-every', '0')
    assert one.returncode == 0, one.stdout + one.stderr
    two = launch(tmp_path / 'two', *SMALL, '--max-steps', '10', '--save-every', '0', processes=2)
    assert two.returncode == 0, two.stdout + two.stderr
    l1, l2 = losses(tmp_path / 'one'), losses(tmp_path / 'two')
    rows = list(csv.DictReader((tmp_path / 'two' / 'metrics.csv').read_text().splitlines()))
    assert [r['processes'] for r in rows] == ['2'] * 10, "two processes trained together, logging each step once"
    assert len(l1) == 10 and l1[10] < l1[1]
    assert_close(l2, l1, rel=1e-4)
    for run in ('one', 'two'):
        assert (tmp_path / run / 'drafter' / 'model.safetensors').is_file()
        assert (tmp_path / run / 'curves.png').is_file(), "drawn by the main process, whatever the processes"
        assert not (tmp_path / run / 'acceptance.png').exists(), "no speculative-decoding evaluation, no histogram"


KILL_ARGS = [*SMALL, '--max-steps', '8', '--save-every', '2', '--keep-checkpoints', '3']


@pytest.fixture(scope='module')
def straight(tmp_path_factory):
    "The uninterrupted run the killed ones are compared with."
    out = tmp_path_factory.mktemp('straight') / 'run'
    r = launch(out, *KILL_ARGS)
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def wait_released(run, timeout: float = 60):
    "Wait until the process holding `run`'s lock has exited: a killed child can outlive its launcher for a moment."
    lock = Path(run) / '.lock'
    if not lock.is_file(): return
    pid, deadline = json.loads(lock.read_text())['pid'], time.time() + timeout
    while time.time() < deadline:
        try: os.kill(pid, 0)
        except ProcessLookupError: return
        time.sleep(0.05)
    raise AssertionError(f"process {pid}, killed, still exists after {timeout} s")


def test_killed_run_resumes_exactly(tmp_path, straight):
    args = KILL_ARGS
    proc = launch(tmp_path / 'killed', *args, wait=False)
    ckpts = tmp_path / 'killed' / 'checkpoints'
    deadline = time.time() + 600
    while not (ckpts / 'step-0000004').is_dir():                 # kill right after the second checkpoint
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    wait_released(tmp_path / 'killed')
    assert not (tmp_path / 'killed' / 'drafter').exists(), "the run was killed before the end"
    (ckpts / '.step-0000006.partial').mkdir(exist_ok=True)        # and a checkpoint cut off mid-write
    resumed = launch(tmp_path / 'killed', *args, '--resume')
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert 'resumed from' in resumed.stdout + resumed.stderr
    assert_close(losses(tmp_path / 'killed'), losses(straight), rel=1e-6)


def steps(path) -> list[int]:
    return [int(r['step']) for r in csv.DictReader(Path(path).read_text().splitlines())]


@pytest.mark.parametrize('point', ['export', 'final_eval'])
def test_killed_in_final_export_or_evaluation_loses_nothing(tmp_path, straight, point):
    """A kill during the final export or the final evaluation: the final checkpoint (and, for the evaluation, the
    drafter) are already on disk; a resume finishes the rest and gives the uninterrupted run's drafter and metrics."""
    from safetensors.torch import load_file
    import torch
    run = tmp_path / 'killed'
    tests = str(Path(__file__).parent)                              # tests/killed_train.py kills the run at `point`
    killed = launch(run, *KILL_ARGS, '--kill-at', point, module='killed_train',
                    env={'PYTHONPATH': os.pathsep.join(filter(None, [tests, os.environ.get('PYTHONPATH')]))})
    assert killed.returncode != 0 and not (run / 'summary.json').exists(), killed.stdout + killed.stderr
    assert (run / 'checkpoints' / 'step-0000008' / 'trainer_state.json').is_file(), "the final checkpoint came first"
    want = load_file(straight / 'drafter' / 'model.safetensors')
    same = lambda a: a.keys() == want.keys() and all(torch.equal(a[k], want[k]) for k in a)
    if point == 'export': assert not (run / 'drafter').exists() and [p for p in run.glob('.drafter.tmp-*') if p.is_dir()]
    else: assert same(load_file(run / 'drafter' / 'model.safetensors')), "the drafter was exported before evaluation"
    resumed = launch(run, *KILL_ARGS, '--resume')
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert same(load_file(run / 'drafter' / 'model.safetensors')) and not list(run.glob('.drafter.tmp-*'))
    assert json.loads((run / 'run.json').read_text())['status'] == 'finished' and (run / 'summary.json').is_file()
    assert (run / 'curves.png').is_file(), "the resume that finishes the run draws its curves"
    assert steps(run / 'metrics.csv') == steps(straight / 'metrics.csv') == list(range(1, 9))
    assert steps(run / 'eval.csv') == steps(straight / 'eval.csv') == [8], "the final evaluation is logged once"


def test_non_finite_losses_stop_the_run(tmp_path):
    r = launch(tmp_path / 'nan', *override(SMALL, '--max-steps', '20', '--lr', '1e30', '--max-grad-norm', '1e30',
                                           '--max-bad-steps', '3', '--save-every', '0'))
    assert r.returncode != 0
    assert '3 non-finite steps in a row' in r.stdout + r.stderr


def test_help_documents_every_option():
    "Every option with its help text; the defaults shown are the recipe's, and the text names the toy profile's values."
    from dataclasses import fields
    from dflash.core.schema import TrainConfig, toy_profile
    r = subprocess.run([sys.executable, '-m', 'dflash.train', '--help'], capture_output=True, text=True)
    assert r.returncode == 0
    text, packed = ' '.join(r.stdout.split()), ''.join(r.stdout.split())     # help lines wrap at spaces and hyphens
    for f in fields(TrainConfig):
        assert '--' + f.name.replace('_', '-') in text and ''.join(f.metadata['help'].split()) in packed, f.name
    assert f"(default: {TrainConfig.num_anchors})" in text and f"(default: {TrainConfig.lr})" in text
    toy = toy_profile(resolve=False)
    assert f"--num-anchors {toy['num_anchors']}, " in text and f"--lr {toy['lr']}, " in text, text[:1500]
    assert 'With no --target the run is the toy profile' in text and '--config' in text


def _inked(png) -> float:
    "The share of a PNG's pixels that are not background white (after checking it decodes as a PNG)."
    from PIL import Image
    import numpy as np
    assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n', png
    a = np.asarray(Image.open(png).convert('L'))
    return float((a < 250).mean())


def test_run_draws_its_pictures(tmp_path):
    "The main job draws curves.png and acceptance.png in its run directory and says where; a finished run is kept."
    run = tmp_path / 'run'
    r = launch(run, *override(SMALL, '--max-steps', '4', '--eval-every', '2', '--save-every', '0',
                              '--spec-eval-prompts', '2', '--spec-new-tokens', '16'))
    assert r.returncode == 0, r.stdout + r.stderr
    for name, what in (('curves.png', 'training curves'), ('acceptance.png', 'acceptance histogram')):
        assert f"{what}: {run / name}" in r.stdout, r.stdout
        assert 0.01 < _inked(run / name) < 0.9, name               # axes, lines and bars drawn, not a blank page
    assert not [p for p in run.iterdir() if '.tmp-' in p.name], "written atomically: no temporary file left"
    after = json.loads((run / 'summary.json').read_text())['spec_after']       # greedy tau, and T = 1 with two seeds
    assert after['prompts'] == 2 and after['sampled']['temperature'] == 1 and len(after['sampled']['tau']) == 2, after
    assert 'at T=1' in r.stdout and '(seeds 0 and 1), on 2 prompts' in r.stdout, r.stdout
    drawn = {n: (run / n).read_bytes() for n in ('curves.png', 'acceptance.png')}
    again = launch(run, *SMALL, '--max-steps', '4', '--resume')
    assert again.returncode == 0 and 'leaves it as it is' in again.stdout, again.stdout + again.stderr
    assert {n: (run / n).read_bytes() for n in drawn} == drawn, "a finished run is left unchanged"


def test_help_shows_one_default_per_option():
    "Each option's help names exactly one default: the field's (the recipe's), or what an unset one does."
    import re
    from dataclasses import fields, MISSING
    from dflash.core.schema import TrainConfig
    r = subprocess.run([sys.executable, '-m', 'dflash.train', '--help'], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    entries, name = {}, None
    for line in r.stdout.split('options:', 1)[1].splitlines():
        if m := re.match(r'  (--[\w-]+)', line): name = m[1]
        if name: entries[name] = entries.get(name, '') + ' ' + line.strip()
    for f in fields(TrainConfig):
        text = ' '.join(entries['--' + f.name.replace('_', '-')].split())
        shown = re.findall(r'\(default: ([^()]*(?:\([^()]*\)[^()]*)*)\)', text)
        assert len(shown) == 1, (f.name, text)
        value = ' '.join(map(str, f.default)) if isinstance(f.default, tuple) else f.default
        if value is not None and value is not MISSING:                  # help lines wrap at spaces and hyphens
            assert ''.join(shown[0].split()) == ''.join(str(value).split()), (f.name, shown[0], value)


def test_help_loads_no_heavy_module():
    "`--help` stays fast: the command's module imports neither torch nor matplotlib (they load when a run starts)."
    code = "import sys, dflash.train.command; print(sorted({'torch', 'matplotlib', 'accelerate'} & set(sys.modules)))"
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == '[]', r.stdout + r.stderr


@pytest.mark.parametrize('how', ['launcher default', 'user OMP_NUM_THREADS', '--threads'])
def test_cpu_threads_follow_the_users_choice(tmp_path, how):
    """`accelerate launch` gives its process OMP_NUM_THREADS=1 when nobody chose: the trainer then takes the cores
    available; an OMP_NUM_THREADS the user set before launching, or `--threads`, wins."""
    from dflash.bench.harness import launch_commands
    from dflash.core.threads import cores_available
    args = [*SMALL, '--max-steps', '1', *(['--threads', '1'] if how == '--threads' else [])]
    cmd = launch_commands(tmp_path / 'run', *args)[0]
    env = {k: v for k, v in os.environ.items() if k != 'OMP_NUM_THREADS'}
    if how == 'user OMP_NUM_THREADS': env['OMP_NUM_THREADS'] = '1'
    r = subprocess.run(cmd, env={**env, 'ACCELERATE_USE_CPU': 'true'}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    said = re.search(r"CPU threads: (\d+) per process \(([^)]*)\)", r.stdout)
    assert said, r.stdout[-2000:]
    n, why = int(said[1]), said[2]
    if how == 'launcher default':                    # the cores, or those that other work (other tests) leaves free
        C = cores_available()
        busy = re.fullmatch(rf"{C} cores, ([\d.]+) of them busy with other work", why)
        assert (n, why) == (C, f"{C} cores / 1 process") or (busy and 1 <= n < C), (n, why)
    else: assert (n, why) == (1, 'OMP_NUM_THREADS' if how == 'user OMP_NUM_THREADS' else '--threads'), (n, why)
    assert json.loads((tmp_path / 'run' / 'summary.json').read_text())['threads'] == n


@pytest.mark.parametrize('tracker', ['none', 'tensorboard'])
def test_report_to_chooses_the_tracker(tmp_path, tracker):
    "`--report-to none` writes no tracker directory, `tensorboard` its own; the CSVs and curves are written either way."
    r = launch(tmp_path / 'run', *SMALL, '--max-steps', '2', '--report-to', tracker)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    written = sorted(p.name for p in (tmp_path / 'run').iterdir())
    assert {'metrics.csv', 'curves.png', 'summary.json'} <= set(written), written
    assert ('tensorboard' in written) == (tracker == 'tensorboard') and 'dflash' not in written, written



def _running(pid: int) -> bool:
    "Whether process `pid` runs (exists and is not a zombie waiting to be reaped)."
    try: os.kill(pid, 0)
    except ProcessLookupError: return False
    try: return Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[0] != 'Z'
    except OSError: return False


def _until(ok, timeout: float, what: str):
    deadline = time.time() + timeout
    while not ok():
        assert time.time() < deadline, what
        time.sleep(0.05)


@pytest.fixture(scope='module')
def straight_two(tmp_path_factory):
    "The uninterrupted run on two processes."
    out = tmp_path_factory.mktemp('straight-two') / 'run'
    r = launch(out, *KILL_ARGS, processes=2)
    assert r.returncode == 0, r.stdout + r.stderr
    return out


@pytest.mark.parametrize('to,processes', [('process group', 1), ('launcher', 1), ('trainer without launcher', 1),
                                          ('process group', 2)])
def test_sigterm_checkpoints_releases_and_resumes_exactly(tmp_path, request, to, processes):
    """SIGTERM to a running `accelerate launch -m dflash.train`: to its process group (as a cluster or Ctrl-C sends it;
    with 2 processes the launcher forwards it too), or to the launcher alone, which dies at once and leaves the trainer
    to notice; or to `python -m dflash.train` run without a launcher, whose exit status is then the trainer's own. The
    trainer stops before its next micro-batch or step (every process at the same one), checkpoints the last whole step,
    releases the lock, says so and exits;
    nothing of it keeps running; --resume takes over a stale lock from another host and ends with the uninterrupted
    run's drafter, bit for bit, and its loss curve."""
    from safetensors.torch import load_file
    import torch
    straight = request.getfixturevalue('straight' if processes == 1 else 'straight_two')
    run = tmp_path / 'run'
    args = override(KILL_ARGS, '--save-every', '0')                       # no periodic checkpoint: the signal's is the only one
    if to == 'trainer without launcher':
        env = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONUNBUFFERED': '1', 'TOKENIZERS_PARALLELISM': 'false'}
        proc = subprocess.Popen([sys.executable, '-m', 'dflash.train', '--out', str(run), *args], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    else: proc = launch(run, *args, processes=processes, wait=False)
    logged = lambda: (run / 'metrics.csv').is_file() and len(steps(run / 'metrics.csv')) >= 2
    _until(lambda: logged() or proc.poll() is not None, 600, "two steps logged")
    assert proc.poll() is None and not (run / 'checkpoints').exists(), proc.stdout.read()
    trainer = json.loads((run / '.lock').read_text())['pid']
    if to == 'process group': os.killpg(proc.pid, signal.SIGTERM)
    else: os.kill(proc.pid, signal.SIGTERM)
    out = proc.communicate(timeout=300)[0]                         # the pipe closes once the trainer exits too
    _until(lambda: not _running(trainer), 60, f"trainer process {trainer} still runs")
    # the launcher's death reaches the trainer as its exit or as the SIGTERM accelerate forwards, whichever comes first
    cause = '(?:the exit of its launcher|SIGTERM)' if to == 'launcher' else 'SIGTERM'
    m = re.search(rf"stopped by {cause}.* after step (\d+) of 8: checkpoint (\S+) written; {run} is released: "
                  r"continue with --resume \(exit status 75\)", out)
    assert m, out
    if to == 'trainer without launcher': assert proc.returncode == 75
    stopped = int(m[1])
    assert 2 <= stopped < 8 and m[2] == str(run / 'checkpoints' / f'step-{stopped:07d}'), out
    assert [d.name for d in (run / 'checkpoints').iterdir()] == [f'step-{stopped:07d}']
    assert not (run / '.lock').exists() and not (run / 'drafter').exists()
    record = json.loads((run / 'run.json').read_text())
    assert record['status'] == 'stopped' and m[0].startswith(record['stops'][0]['what'])
    (run / '.lock').write_text(json.dumps({'pid': 1, 'host': 'elsewhere', 'started': 'then',
                                           'heartbeat': time.time() - 3600}))   # another host's run, long silent
    resumed = launch(run, *KILL_ARGS, '--resume', processes=processes)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert re.search(r'last beat \d+ s ago \(stale after 600 s\); taking over its stale lock', resumed.stdout)
    assert f'resumed from {run / "checkpoints" / f"step-{stopped:07d}"} at step {stopped}' in resumed.stdout
    want, got = load_file(straight / 'drafter' / 'model.safetensors'), load_file(run / 'drafter' / 'model.safetensors')
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert losses(run) == losses(straight)
    record = json.loads((run / 'run.json').read_text())
    assert record['status'] == 'finished' and len(record['stops']) == 1, record

def test_sigterm_during_a_step_longer_than_the_launchers_patience(tmp_path):
    """accelerate's launcher, sent SIGTERM, passes it on and kills the trainer 5 s later. With steps longer than that
    (a batch of 160 on the toy target here), the trainer drops the step in progress at its next micro-batch and
    checkpoints the one before, well within the 5 s."""
    run = tmp_path / 'run'
    proc = launch(run, *override(KILL_ARGS, '--save-every', '0', '--batch-size', '160'), wait=False)
    _until(lambda: (run / 'metrics.csv').is_file() or proc.poll() is not None, 600, "a step logged")
    os.killpg(proc.pid, signal.SIGTERM)                                   # the launcher and the trainer, as Ctrl-C
    out = proc.communicate(timeout=300)[0]
    assert re.search(rf"stopped by SIGTERM after step 1 of 8: checkpoint {re.escape(str(run))}\S+ written", out), out
    assert [d.name for d in (run / 'checkpoints').iterdir()] == ['step-0000001'] and not (run / '.lock').exists()


def test_sigint_without_save_on_signal_stops_and_releases(tmp_path):
    "Ctrl-C (SIGINT) with --save-on-signal false: the step ends, nothing is checkpointed, the lock is released, exit 75."
    run = tmp_path / 'run'
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONUNBUFFERED': '1', 'TOKENIZERS_PARALLELISM': 'false'}
    proc = subprocess.Popen([sys.executable, '-m', 'dflash.train', '--out', str(run), *override(KILL_ARGS, '--save-every', '0'),
                             '--save-on-signal', 'false'], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    _until(lambda: (run / 'metrics.csv').is_file() or proc.poll() is not None, 600, "a step logged")
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 75, out
    assert re.search(r"stopped by SIGINT after step \d of 8: not checkpointed \(--save-on-signal false\)", out), out
    assert 'Traceback' not in out and 'KeyboardInterrupt' not in out, out
    assert not (run / 'checkpoints').exists() and not (run / '.lock').exists()


def test_distillation_reads_the_same_teacher_online_and_from_the_cache(tmp_path):
    """`--loss kl` online, and from a cache written with --final-hidden: the same losses, held-out ones too; over a draft
    vocabulary; `--loss tv` trains from the same cache; D-PACE trains too."""
    from dflash.core.files import toy_data_dir, toy_target_dir
    data = tmp_path / 'train.jsonl'
    data.write_text(''.join((toy_data_dir() / 'train.jsonl').read_text().splitlines(True)[:12]))
    cache = tmp_path / 'cache'
    r = subprocess.run([sys.executable, '-m', 'dflash.data', 'cache', '--target', str(toy_target_dir()), '--data',
                        str(data), '--out', str(cache), '--max-length', '128', '--num-draft-layers', '2',
                        '--final-hidden', '--no-progress', '--threads', '1'], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((cache / 'manifest.json').read_text())['final_hidden'] is True
    kl = [*SMALL, '--max-steps', '3', '--save-every', '0', '--report-to', 'none', '--target', str(toy_target_dir()),
          '--loss', 'kl', '--kl-weight', '0.5', '--kl-temperature', '2', '--eval-data', str(toy_data_dir() / 'eval.jsonl')]
    online = launch(tmp_path / 'online', *kl, '--data', str(data))
    assert online.returncode == 0, online.stdout[-2000:] + online.stderr[-2000:]
    offline = launch(tmp_path / 'offline', *kl, '--cache', str(cache))
    assert offline.returncode == 0, offline.stdout[-2000:] + offline.stderr[-2000:]
    assert_close(losses(tmp_path / 'offline'), losses(tmp_path / 'online'), rel=1e-5)
    held_out = lambda run: next(csv.DictReader((run / 'eval.csv').read_text().splitlines()))
    on, off = held_out(tmp_path / 'online'), held_out(tmp_path / 'offline')   # a cached run evaluates held-out data too
    assert_close({k: float(v) for k, v in off.items()}, {k: float(v) for k, v in on.items()}, rel=1e-5)
    record = json.loads((tmp_path / 'online' / 'run.json').read_text())['config']
    assert (record['loss'], record['kl_weight'], record['kl_temperature']) == ('kl', 0.5, 2.0)
    pruned = launch(tmp_path / 'pruned', *kl, '--cache', str(cache), '--draft-vocab-size', '64')   # over 64 tokens
    assert pruned.returncode == 0, pruned.stdout[-2000:] + pruned.stderr[-2000:]
    assert json.loads((tmp_path / 'pruned' / 'drafter' / 'config.json').read_text())['draft_vocab_size'] == 64
    assert len(losses(tmp_path / 'pruned')) == 3 and all(0 < v < float('inf') for v in losses(tmp_path / 'pruned').values())
    tv = launch(tmp_path / 'tv', *override(kl, '--loss', 'tv', '--kl-weight', '0.9'), '--cache', str(cache))  # 0.9·TV + 0.1·CE
    assert tv.returncode == 0, tv.stdout[-2000:] + tv.stderr[-2000:]
    assert len(losses(tmp_path / 'tv')) == 3 and all(0 < v < float('inf') for v in losses(tmp_path / 'tv').values())
    record = json.loads((tmp_path / 'tv' / 'run.json').read_text())['config']
    assert (record['loss'], record['kl_weight'], record['kl_temperature']) == ('tv', 0.9, 2.0)
    dpace = launch(tmp_path / 'dpace', *SMALL, '--max-steps', '3', '--save-every', '0', '--report-to', 'none',
                   '--loss', 'dpace', '--dpace-alpha', '0.3')
    assert dpace.returncode == 0, dpace.stdout[-2000:] + dpace.stderr[-2000:]
    assert len(losses(tmp_path / 'dpace')) == 3


def test_a_cache_of_more_layers_trains_a_drafter_of_some_of_them(tmp_path):
    """One cache of four target layers serves a drafter reading two of them: the same losses as that drafter online;
    the run says its mask token is the cache's."""
    from dflash.core.files import toy_data_dir, toy_target_dir
    data = tmp_path / 'train.jsonl'
    data.write_text(''.join((toy_data_dir() / 'train.jsonl').read_text().splitlines(True)[:12]))
    cache = tmp_path / 'cache'
    r = subprocess.run([sys.executable, '-m', 'dflash.data', 'cache', '--target', str(toy_target_dir()), '--data',
                        str(data), '--out', str(cache), '--max-length', '128', '--layers', '0,1,2,3', '--no-progress',
                        '--threads', '1'], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    run = [*SMALL, '--max-steps', '3', '--save-every', '0', '--report-to', 'none', '--target', str(toy_target_dir()),
           '--target-layer-ids', '3', '1']
    online = launch(tmp_path / 'online', *run, '--data', str(data))
    assert online.returncode == 0, online.stdout[-2000:] + online.stderr[-2000:]
    offline = launch(tmp_path / 'offline', *run, '--cache', str(cache))
    assert offline.returncode == 0, offline.stdout[-2000:] + offline.stderr[-2000:]
    assert f"the one the cache {cache} was written with" in offline.stdout, offline.stdout[-2000:]
    assert_close(losses(tmp_path / 'offline'), losses(tmp_path / 'online'), rel=1e-5)
    config = json.loads((tmp_path / 'offline' / 'drafter' / 'config.json').read_text())
    assert config['dflash_config']['target_layer_ids'] == [3, 1]


def test_several_caches_train_as_one_cache_of_them_all(tmp_path):
    """Two caches of the two halves of a corpus (`--cache A B`) train exactly as one cache of the whole: the same
    losses, held-out ones too; run.json fingerprints each; caches written with other mask tokens are refused; with
    weights (`--cache-weights`) each cache's share of an epoch follows them, said per cache."""
    from dflash.core.files import toy_data_dir, toy_target_dir
    lines = (toy_data_dir() / 'train.jsonl').read_text().splitlines(True)[:12]
    def cache(name, part, *extra):
        (tmp_path / f'{name}.jsonl').write_text(''.join(part))
        r = subprocess.run([sys.executable, '-m', 'dflash.data', 'cache', '--target', str(toy_target_dir()), '--data',
                            str(tmp_path / f'{name}.jsonl'), '--out', str(tmp_path / name), '--max-length', '128',
                            '--num-draft-layers', '2', '--no-progress', '--threads', '1', *extra],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
        return str(tmp_path / name)
    whole, a, b = cache('whole', lines), cache('a', lines[:6]), cache('b', lines[6:])
    run = [*SMALL, '--max-steps', '3', '--save-every', '0', '--report-to', 'none', '--target', str(toy_target_dir()),
           '--eval-data', str(toy_data_dir() / 'eval.jsonl')]
    one = launch(tmp_path / 'one', *run, '--cache', whole)
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-2000:]
    two = launch(tmp_path / 'two', *run, '--cache', a, b)
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-2000:]
    assert f"the one the caches {a}, {b} were written with" in two.stdout, two.stdout[-2000:]
    assert_close(losses(tmp_path / 'two'), losses(tmp_path / 'one'), rel=1e-5)
    assert_close(held_out(tmp_path / 'two'), held_out(tmp_path / 'one'), rel=1e-5)
    record = json.loads((tmp_path / 'two' / 'run.json').read_text())
    assert record['config']['cache'] == [a, b] and {'cache 1', 'cache 2'} <= record['data'].keys(), record
    mask = json.loads((Path(a) / 'manifest.json').read_text())['data']['mask_token_id']
    other = cache('other', lines[6:], '--mask-token-id', str(mask + 1))
    bad = train_cli('--out', tmp_path / 'bad', *run, '--cache', a, other)
    assert bad.returncode == 2 and 'Traceback' not in bad.stderr, bad.stderr[-2000:]
    assert f"the caches were written with different mask tokens ({a}: {mask}; {other}: {mask + 1})" in bad.stderr, bad.stderr
    mixed = launch(tmp_path / 'mixed', *run, '--cache', a, b, '--cache-weights', '3', '1')
    assert mixed.returncode == 0, mixed.stdout[-2000:] + mixed.stderr[-2000:]
    assert f"mix: {a}: 9 samples an epoch of its 6, 75.0% of the samples" in mixed.stdout, mixed.stdout[-2000:]
    assert f"mix: {b}: 3 samples an epoch of its 6, 25.0% of the samples" in mixed.stdout, mixed.stdout[-2000:]
    wrong = train_cli('--out', tmp_path / 'wrong', *run, '--cache', a, b, '--cache-weights', '0')
    assert wrong.returncode == 2 and 'Traceback' not in wrong.stderr, wrong.stderr[-2000:]
    assert '--cache-weights = [0.0]: allowed > 0' in wrong.stderr, wrong.stderr
    assert '--cache-weights = [0.0]: one weight per --cache (1 for 2 caches)' in wrong.stderr, wrong.stderr


def test_a_run_continues_from_a_trained_drafter(tmp_path):
    """--init-from starts a run from the drafter another run exported: its weights (at learning rate 0 the run
    exports them unchanged) and its draft vocabulary, though the new data would choose another; with more layers it
    grows, the new one adding nothing at first; with a larger draft vocabulary the new data's tokens join, each of
    the start's keeping its row; a drafter of another shape is refused before the target loads, every difference
    named."""
    from safetensors.torch import load_file
    from dflash.core.files import toy_data_dir
    lines = (toy_data_dir() / 'train.jsonl').read_text().splitlines(True)
    first, second = tmp_path / 'first.jsonl', tmp_path / 'second.jsonl'
    first.write_text(''.join(lines[:12]))
    second.write_text(''.join(lines[-12:]))
    run = [*SMALL, '--max-steps', '2', '--save-every', '0', '--report-to', 'none', '--draft-vocab-size', '24']
    a = launch(tmp_path / 'a', *run, '--data', str(first))
    assert a.returncode == 0, a.stdout[-2000:] + a.stderr[-2000:]
    b = launch(tmp_path / 'b', *override(run, '--lr', '0'), '--data', str(second), '--init-from', str(tmp_path / 'a' / 'drafter'))
    assert b.returncode == 0, b.stdout[-2000:] + b.stderr[-2000:]
    assert 'the drafter of --init-from' in b.stdout and "the drafter's of --init-from" in b.stdout, b.stdout[-2000:]
    fresh = launch(tmp_path / 'fresh', *run, '--data', str(second))
    assert fresh.returncode == 0, fresh.stdout[-2000:] + fresh.stderr[-2000:]
    wa, wb, wf = (load_file(tmp_path / r / 'drafter' / 'model.safetensors') for r in ('a', 'b', 'fresh'))
    assert wa.keys() == wb.keys()
    for k in wa: assert torch.equal(wa[k], wb[k]), k
    assert not torch.equal(wf['d2t'], wa['d2t']), "the second data chooses another vocabulary on its own"
    grown = launch(tmp_path / 'grown', *override(run, '--lr', '0', '--num-layers', '3'), '--data', str(second),
                   '--init-from', str(tmp_path / 'a' / 'drafter'))
    assert grown.returncode == 0, grown.stdout[-2000:] + grown.stderr[-2000:]
    assert 'its 2 layers first, 1 new on top starting as the identity' in grown.stdout, grown.stdout[-2000:]
    wg = load_file(tmp_path / 'grown' / 'drafter' / 'model.safetensors')
    for k in wa: assert torch.equal(wa[k], wg[k]), k
    assert not wg['layers.2.self_attn.o_proj.weight'].any() and not wg['layers.2.mlp.down_proj.weight'].any()
    assert_close(held_out(tmp_path / 'grown'), held_out(tmp_path / 'b'), rel=1e-6)   # it drafts as the 2 layers did
    wide = launch(tmp_path / 'wide', *override(run, '--lr', '0', '--draft-vocab-size', '32'), '--data', str(second),
                  '--init-from', str(tmp_path / 'a' / 'drafter'))
    assert wide.returncode == 0, wide.stdout[-2000:] + wide.stderr[-2000:]
    assert 'the 24 tokens of the drafter of --init-from and the 8 most often supervised outside them' in wide.stdout
    ww = load_file(tmp_path / 'wide' / 'drafter' / 'model.safetensors')
    had, has = (w['d2t'] + torch.arange(len(w['d2t'])) for w in (wa, ww))       # target ids, ascending
    at = torch.searchsorted(has, had)
    assert len(has) == 32 and torch.equal(has[at], had), "the vocabulary holds the start's 24 tokens"
    assert torch.equal(ww['lm_head.weight'][at], wa['lm_head.weight']), "each of them keeps its row"
    for k in wa.keys() - {'lm_head.weight', 'd2t', 't2d'}: assert torch.equal(wa[k], ww[k]), k
    bad = train_cli('--out', tmp_path / 'bad', *override(run, '--num-layers', '1', '--draft-vocab-size', '16'),
                    '--block-size', '8', '--data', second, '--init-from', tmp_path / 'a' / 'drafter')
    assert bad.returncode == 2 and 'Traceback' not in bad.stderr, bad.stderr[-2000:]
    assert '--num-layers = 1: the drafter of --init-from' in bad.stderr and '--block-size = 8: the drafter of' in bad.stderr
    assert '--draft-vocab-size = 16: the drafter of --init-from' in bad.stderr, bad.stderr
    both = train_cli('--out', tmp_path / 'both', *run, '--data', second, '--init-from', tmp_path / 'a' / 'drafter',
                     '--init-from-target')
    assert both.returncode == 2 and '--init-from and --init-from-target: choose one' in both.stderr, both.stderr[-2000:]
    assert not (tmp_path / 'bad').exists() and not (tmp_path / 'both').exists()


def test_a_json_array_cut_short_trains_with_skip_bad_lines(tmp_path):
    """Chat data as one JSON array cut in the middle of a record (as ShareGPT's file ships): the run stops before
    training, naming the complete records before the cut and the option that keeps them; with the option it trains
    on those records and counts the cut one as skipped."""
    from dflash.core.files import toy_data_dir
    records = [json.loads(line) for line in (toy_data_dir() / 'train.jsonl').read_text().splitlines()[:40]]
    text = json.dumps(records, indent=1)
    cut = tmp_path / 'cut.json'
    cut.write_text(text[:text.rindex('"content"')])                        # inside the last record
    stopped = train_cli('--out', tmp_path / 'stopped', *SMALL, '--data', cut, '--max-steps', '1', '--save-every', '0')
    said = stopped.stdout + stopped.stderr
    assert stopped.returncode == 2, said
    assert 'a JSON array cut short after 39 complete records' in said and 'pass --skip-bad-lines' in said, said
    assert not (tmp_path / 'stopped' / 'drafter').exists()
    kept = launch(tmp_path / 'kept', *SMALL, '--data', cut, '--skip-bad-lines', '--max-steps', '1', '--save-every', '0')
    said = kept.stdout + kept.stderr
    assert kept.returncode == 0, said
    assert re.search(r'read +39\n +used +39\n +skipped: malformed line \(--skip-bad-lines\) +1\n', said), said
    assert (tmp_path / 'kept' / 'drafter' / 'model.safetensors').is_file()
