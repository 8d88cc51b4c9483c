"""Every command that writes, on a real disk that is full or read-only (a small tmpfs mounted for the test): one
`error:` line naming the file and the cause, exit status 2, no traceback, nothing half-written left; with room again,
the same command continues."""
import hashlib, os, subprocess, sys
from pathlib import Path
import pytest
from conftest import override
from dflash.core.files import assets_dir, toy_data_dir, toy_target_dir

TRAIN = ['--max-steps', '2', '--num-layers', '2', '--batch-size', '4', '--num-anchors', '16', '--max-length', '128',
         '--spec-eval-prompts', '0', '--progress-bar', 'false', '--report-to', 'none', '--seed', '1']
CAUSE = {'full': 'No space left on device (ENOSPC)', 'read-only': 'Read-only file system (EROFS)'}


@pytest.fixture(scope='module')
def data(tmp_path_factory) -> Path:
    "40 toy conversations."
    p = tmp_path_factory.mktemp('data') / 'small.jsonl'
    p.write_text('\n'.join((toy_data_dir() / 'train.jsonl').read_text().splitlines()[:40]) + '\n')
    return p


@pytest.fixture
def disk(tmp_path):
    "`disk(size)`: a fresh tmpfs of `size` (e.g. '300k') mounted under tmp_path; unmounted after the test."
    if os.geteuid() != 0: pytest.skip("mounting a small tmpfs needs root")
    mounted = []
    def mount(size: str) -> Path:
        d = tmp_path / f'disk{len(mounted)}'
        d.mkdir()
        r = subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={size}', 'tmpfs', str(d)], capture_output=True,
                           text=True)
        if r.returncode: pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(d)
        return d
    yield mount
    for d in mounted: subprocess.run(['umount', '-l', str(d)], capture_output=True)


def remount(d: Path, options: str):
    subprocess.run(['mount', '-o', f'remount,{options}', str(d)], check=True)


def run(module: str, *args, env=None) -> subprocess.CompletedProcess:
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'TOKENIZERS_PARALLELISM': 'false', **(env or {})}
    return subprocess.run([sys.executable, '-m', module, *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=600)


def refused(r: subprocess.CompletedProcess, path: Path, kind: str):
    "Exit 2, one error line naming a file under `path` and the cause, no traceback."
    err = r.stderr
    assert r.returncode == 2 and 'Traceback' not in err, err[-3000:]
    line = next((x for x in err.splitlines() if x.startswith('error: ')), '')
    assert line.startswith(f'error: {path}') and CAUSE[kind] in line, err[-3000:]


def leftovers(d: Path) -> list[str]:
    "Half-written files: temporaries and partial checkpoints."
    return [str(p) for p in d.rglob('*') if p.name.startswith('.') or '.partial' in p.name or '.tmp-' in p.name]


def sha(p: Path) -> str: return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.mark.parametrize('kind', ['full', 'read-only'])
def test_train_start(disk, data, kind):
    d = disk('4k')                                                     # a page: not even run.json
    if kind == 'read-only': remount(d, 'ro')
    r = run('dflash.train', '--out', d / 'run', '--data', data, *TRAIN)
    refused(r, d, kind)
    assert not (d / 'run' / 'run.json').exists() and not leftovers(d)


@pytest.mark.parametrize('kind', ['full', 'read-only'])
def test_train_checkpoint(disk, data, kind):
    "Full: the first checkpoint does not fit. Read-only: a finished run extended on a disk remounted read-only."
    d = disk('300k' if kind == 'full' else '16m')
    base = ['--out', d / 'run', '--data', data, '--save-every', '1', *TRAIN]
    if kind == 'read-only':
        assert run('dflash.train', *override(base, '--max-steps', '1')).returncode == 0
        remount(d, 'ro')
    r = run('dflash.train', *base, *(['--resume'] if kind == 'read-only' else []))
    refused(r, d / 'run', kind)
    assert not leftovers(d / 'run') and not (d / 'run' / '.lock').exists()


def test_train_export_then_resume(disk, data, tmp_path):
    "The final checkpoint fits, the exported drafter does not: with room, --resume exports the uninterrupted drafter."
    whole = tmp_path / 'whole'
    assert run('dflash.train', '--out', whole, '--data', data, '--save-every', '0', *TRAIN).returncode == 0
    d = disk('6000k')                                                  # the checkpoint (5.1 MB), not the drafter too
    r = run('dflash.train', '--out', d / 'run', '--data', data, '--save-every', '0', *TRAIN)
    refused(r, d / 'run', 'full')
    assert 'drafter' in r.stderr.split('error: ')[1].split(':')[0]
    assert not leftovers(d / 'run')
    remount(d, 'size=16m')
    again = run('dflash.train', '--out', d / 'run', '--resume')
    assert again.returncode == 0, again.stderr[-3000:]
    assert sha(d / 'run' / 'drafter' / 'model.safetensors') == sha(whole / 'drafter' / 'model.safetensors')


@pytest.mark.parametrize('kind', ['full', 'read-only'])
def test_cache_then_continue(disk, data, kind):
    d = disk('64k')
    cmd = ['dflash.data', 'cache', '--target', toy_target_dir(), '--data', data, '--out', d / 'cache', '--shard-size',
           '8', '--no-progress']
    if kind == 'read-only': remount(d, 'ro')
    refused(run(*cmd), d, kind)
    assert not leftovers(d)
    remount(d, 'rw,size=16m')
    r = run(*cmd)
    assert r.returncode == 0 and 'cache: ' in r.stdout, r.stderr[-3000:]


@pytest.mark.parametrize('kind', ['full', 'read-only'])
def test_regenerate_then_continue(disk, data, kind):
    d = disk('8k')
    cmd = ['dflash.regenerate', '--data', data, '--out', d / 'r.jsonl', '--batch-size', '8', '--max-new-tokens', '8',
           '--no-progress']
    if kind == 'read-only': remount(d, 'ro')
    refused(run(*cmd), d, kind)
    out = d / 'r.jsonl'
    assert not out.exists() or out.read_text().count('\n') == len(out.read_text().splitlines())   # whole lines
    assert not (d / 'r.jsonl.lock').exists()
    remount(d, 'rw,size=16m')
    r = run(*cmd)
    assert r.returncode == 0 and len(out.read_text().splitlines()) == 40, r.stderr[-3000:]


@pytest.mark.parametrize('kind', ['full', 'read-only'])
def test_tokenize(disk, data, kind):
    "The tokenized-data cache (HF_DATASETS_CACHE) on a disk that refuses it."
    d = disk('8k')
    if kind == 'read-only': remount(d, 'ro')
    r = run('dflash.data', 'tokenize', '--target', toy_target_dir(), '--data', data,
            env={'HF_DATASETS_CACHE': str(d / 'hf')})
    refused(r, d, kind)
    assert not leftovers(d)


@pytest.mark.parametrize('kind', ['full', 'read-only'])
def test_speculate(disk, data, kind):
    "A full --out: found when the results are written; a read-only one: refused with the options, before decoding."
    d = disk('8k')
    if kind == 'read-only': remount(d, 'ro')
    r = run('dflash.speculate', '--target', toy_target_dir(), '--drafter', assets_dir() / 'toy-drafter', '--data', data,
            '--num-prompts', '2', '--max-new-tokens', '8', '--out', d / 'spec')
    if kind == 'full': refused(r, d / 'spec', kind)
    else: assert r.returncode == 2 and f"--out = '{d / 'spec'}': cannot write there" in r.stderr, r.stderr[-3000:]
    assert not leftovers(d)
