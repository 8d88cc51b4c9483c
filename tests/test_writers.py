"""What the commands write, and where: a writer removes only what it wrote, refuses a directory that is another's (the
target, the data, a run, a cache), never follows a link planted at a temporary name, and a tracker that fails is a
side channel lost, not a run lost. Real processes, real files and real links."""
import json, os, shutil, socket, stat, subprocess, sys, time
from pathlib import Path
import pytest
from dflash.core.files import toy_target_dir, toy_data_dir
from dflash.data.command import main as data_main
from dflash.train.command import main as train_main
from conftest import SMALL, refused, train_cli, tree

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, 'OMP_NUM_THREADS': '1', 'TOKENIZERS_PARALLELISM': 'false',
       'PYTHONPATH': str(ROOT) + os.pathsep + os.environ.get('PYTHONPATH', '')}
QUICK = [*SMALL, '--eval-every', '0', '--eval-samples', '2', '--save-every', '0']   # SMALL: conftest's small toy run


@pytest.fixture(scope='module')
def inputs(tmp_path_factory):
    "A few toy conversations and a copy of the toy target (a model directory a wrong --out could write into)."
    d = tmp_path_factory.mktemp('inputs')
    lines = (toy_data_dir() / 'train.jsonl').read_text().splitlines()
    (d / 'chat.jsonl').write_text('\n'.join(lines[:6]) + '\n')
    shutil.copytree(toy_target_dir(), d / 'target')
    return d


def cache_args(inputs, out):
    return ['cache', '--target', str(inputs / 'target'), '--data', str(inputs / 'chat.jsonl'), '--layers', '1',
            '--shard-size', '2', '--no-progress', '--threads', '1', '--out', str(out)]


# --- 1. a writer removes only what it wrote ------------------------------------------------------------------------
def test_cache_keeps_the_hidden_files_it_did_not_write(tmp_path, inputs):
    out = tmp_path / 'cache'
    out.mkdir()
    (out / '.env').write_text('SECRET=1\n')
    (out / '.gitignore').write_text('*\n')
    (out / '.manifest.json.tmp-4242').write_text('half')                 # what a killed cache writer leaves
    r = train_cli(*cache_args(inputs, out), module='dflash.data')
    assert r.returncode == 0, r.stderr
    assert (out / '.env').read_text() == 'SECRET=1\n' and (out / '.gitignore').read_text() == '*\n'
    assert not (out / '.manifest.json.tmp-4242').exists()
    assert json.loads((out / 'manifest.json').read_text())['complete']


def test_cache_refuses_a_running_trainings_directory(tmp_path, inputs, capsys):
    run = tmp_path / 'run'
    run.mkdir()
    lock = {'pid': os.getpid(), 'host': socket.gethostname(), 'started': 'now', 'heartbeat': time.time()}
    (run / '.lock').write_text(json.dumps(lock))                       # a training that has just started
    refused(capsys, data_main, cache_args(inputs, run),
            f"--out = '{run}': holds a training run (.lock), which this command does not write")
    assert json.loads((run / '.lock').read_text()) == lock and sorted(p.name for p in run.iterdir()) == ['.lock']


@pytest.mark.parametrize('which', ['target', 'data'])
def test_cache_refuses_the_directory_it_reads(tmp_path, inputs, capsys, which):
    out = inputs / 'target' if which == 'target' else inputs
    before = tree(out)
    refused(capsys, data_main, cache_args(inputs, out),
            f"--out = '{out}': {'is' if which == 'target' else 'holds'} --{which}", 'choose another directory')
    assert tree(out) == before


@pytest.mark.parametrize('overwrite', [False, True])
def test_train_refuses_out_equal_to_target_before_writing(tmp_path, inputs, capsys, overwrite):
    target = tmp_path / 'model'
    shutil.copytree(inputs / 'target', target)
    before = tree(target)
    refused(capsys, train_main, [*QUICK, '--max-steps', '1', '--target', str(target), '--data',
                                 str(inputs / 'chat.jsonl'), '--out', str(target), *(['--overwrite'] if overwrite else [])],
            f"--out = '{target}': is --target")
    assert tree(target) == before and sorted(p.name for p in tmp_path.iterdir()) == ['model']   # nothing moved aside


def test_train_refuses_a_cache_directory(tmp_path, capsys):
    cache = tmp_path / 'cache'
    cache.mkdir()
    (cache / 'manifest.json').write_text('{"format": "dflash-hidden-cache/1"}')
    refused(capsys, train_main, [*QUICK, '--max-steps', '1', '--out', str(cache)],
            "holds a hidden-state cache (manifest.json), which this command does not write")
    assert sorted(p.name for p in cache.iterdir()) == ['manifest.json']


# --- 2. temporary files and locks: new names, created exclusively, links never followed ----------------------------
PLANT = """
import os, sys
from pathlib import Path
out, victim = Path(sys.argv[1]), sys.argv[2]
os.umask(0)                                            # the loosest umask: the run directory still is not world-writable
out.mkdir(mode=0o755)
for name in (f'.lock.{os.getpid()}', f'.run.json.tmp-{os.getpid()}', '.drafter.partial'):
    os.symlink(victim, out / name)                     # where an older dflash wrote its temporaries, by this pid
from dflash.train.command import main
main(sys.argv[3:])
"""


def test_links_planted_at_the_old_temporary_names_are_not_followed(tmp_path):
    out, victim = tmp_path / 'run', tmp_path / 'victim'
    victim.write_text('root-owned file that must not change\n')
    r = subprocess.run([sys.executable, '-c', PLANT, str(out), str(victim), *QUICK, '--max-steps', '2', '--out',
                        str(out), '--report-to', 'none'], env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert victim.read_text() == 'root-owned file that must not change\n'
    assert json.loads((out / 'run.json').read_text())['status'] == 'finished'
    assert (out / 'drafter' / 'model.safetensors').is_file() and not (out / 'drafter').is_symlink()
    for d in (out, out / 'checkpoints', out / 'drafter'):
        assert not d.stat().st_mode & stat.S_IWOTH, (d, oct(d.stat().st_mode))


def test_world_writable_out_is_refused(tmp_path, capsys):
    out = tmp_path / 'shared'
    out.mkdir()
    os.chmod(out, 0o777)
    refused(capsys, train_main, [*QUICK, '--max-steps', '1', '--out', str(out)],
            f"--out = '{out}': every user may write to it (mode 777)")
    assert list(out.iterdir()) == []


# --- 3. trackers are side channels ---------------------------------------------------------------------------------
def test_tracker_that_cannot_start_leaves_no_run_record(tmp_path):
    out = tmp_path / 'run'
    out.mkdir()
    (out / 'tensorboard').write_text('a file where TensorBoard wants its directory\n')
    r = train_cli(*QUICK, '--max-steps', '1', '--out', out)
    assert r.returncode == 2, r.stderr
    assert 'error: --report-to tensorboard: the tracker did not start' in r.stderr and 'Traceback' not in r.stderr
    assert not (out / 'run.json').exists() and not (out / '.lock').exists()
    again = train_cli(*QUICK, '--max-steps', '1', '--out', out, '--report-to', 'none')   # the corrected command runs
    assert again.returncode == 0, again.stderr


def test_tracker_that_fails_mid_run_warns_once_and_the_run_goes_on(tmp_path):
    out, steps = tmp_path / 'run', 24
    p = subprocess.Popen([sys.executable, '-m', 'dflash.train', *QUICK, '--max-steps', str(steps), '--out', str(out)],
                         env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None:
        m = out / 'metrics.csv'
        if m.is_file() and len(m.read_text().splitlines()) >= 3: break   # header and two steps: TensorBoard is writing
        time.sleep(0.2)
    shutil.move(out / 'tensorboard', tmp_path / 'moved')                # its directory gone, a file in its place
    (out / 'tensorboard').write_text('not a directory\n')
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    assert err.count('warning: --report-to tensorboard: the tracker failed') == 1, err
    rows = (out / 'metrics.csv').read_text().splitlines()[1:]
    assert [int(r.split(',')[0]) for r in rows] == list(range(1, steps + 1))    # the CSV kept every step
    assert json.loads((out / 'run.json').read_text())['status'] == 'finished'
    assert (out / 'drafter' / 'model.safetensors').is_file()


def test_checksum_memo_keeps_every_writers_entry(tmp_path):
    "Processes that hash targets at once share one memo of weights checksums: a lock keeps each one's entries."
    n, k = 64, 4
    for i in range(n):
        (tmp_path / f't{i}').mkdir()
        (tmp_path / f't{i}' / 'config.json').write_text('{}')
        (tmp_path / f't{i}' / 'model.safetensors').write_bytes(os.urandom(1 << 12))
    code = ("import sys, time; from pathlib import Path; from dflash.data.features import target_identity\n"
            "d = Path(sys.argv[2])\n"
            "while not (d / 'go').exists(): time.sleep(0.01)\n"          # all start together, once imported
            f"for i in range(int(sys.argv[1]), {n}, {k}): target_identity(d / f't{{i}}')")
    env = {**ENV, 'XDG_CACHE_HOME': str(tmp_path / 'xdg')}
    procs = [subprocess.Popen([sys.executable, '-c', code, str(j), str(tmp_path)], env=env) for j in range(k)]
    time.sleep(10)
    (tmp_path / 'go').touch()
    assert [p.wait(timeout=300) for p in procs] == [0] * k
    memo = json.loads((tmp_path / 'xdg' / 'dflash' / 'weights-sha256.json').read_text())
    assert sorted(key.split('|')[0] for key in memo) == sorted(str((tmp_path / f't{i}' / 'model.safetensors').resolve())
                                                           for i in range(n))
