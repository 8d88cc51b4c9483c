"Hub ids resolve from a hand-made local Hugging Face cache only; a missing one fails fast, naming where it looked."
import json, os, re, shlex, shutil, subprocess, sys, time
from pathlib import Path
import numpy as np
import pytest, torch
from conftest import override
from dflash.core.files import resolve_local, toy_target_dir, toy_data_dir, assets_dir
from dflash.bench.harness import launch_commands
from dflash.data.features import TargetFeatures
from dflash.data.cache import CacheDataset
from dflash.data.chat import load_chat_data
from dflash.data.command import main
from dflash.model.drafter import DFlashDrafter

ROOT = Path(__file__).resolve().parents[1]


def _hub_entry(hub, kind, repo, files_from, commit='0123456789abcdef0123456789abcdef01234567'):
    "Lay out `repo` as huggingface_hub does: refs/main -> commit, snapshots/<commit>/<files> (links to blobs)."
    d = hub / f"{kind}s--{repo.replace('/', '--')}"
    (d / 'refs').mkdir(parents=True)
    (d / 'refs' / 'main').write_text(commit)
    snap = d / 'snapshots' / commit
    snap.mkdir(parents=True)
    (d / 'blobs').mkdir()
    for f in sorted(Path(files_from).iterdir()):
        if f.is_file():
            blob = d / 'blobs' / f"{abs(hash(f.name)):x}"
            shutil.copy(f, blob)
            os.symlink(os.path.relpath(blob, snap), snap / f.name)
    return snap


@pytest.fixture
def hub(tmp_path, monkeypatch, chat_targets):
    hub = tmp_path / 'hub'
    monkeypatch.setenv('HF_HUB_CACHE', str(hub))
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    monkeypatch.setenv('HF_DATASETS_CACHE', str(tmp_path / 'datasets-cache'))
    snap = _hub_entry(hub, 'model', 'acme/tiny-qwen3', chat_targets['qwen3'])
    data = tmp_path / 'data'
    data.mkdir()
    rng = np.random.default_rng(0)
    words = 'the a cat dog runs jumps over under red blue green house tree river'.split()
    with open(data / 'train.jsonl', 'w') as f:
        for _ in range(6):
            f.write(json.dumps({'messages': [{'role': 'user', 'content': ' '.join(rng.choice(words, 5))},
                                             {'role': 'assistant', 'content': ' '.join(rng.choice(words, 8))}]}) + '\n')
    dsnap = _hub_entry(hub, 'dataset', 'acme/chats', data)
    return hub, snap, dsnap


def test_hub_ids_resolve_from_the_local_cache(hub, chat_targets):
    cache, snap, dsnap = hub
    assert resolve_local('acme/tiny-qwen3') == snap and resolve_local('acme/chats', 'dataset') == dsnap
    t = TargetFeatures('acme/tiny-qwen3', num_draft_layers=2)
    local = TargetFeatures(chat_targets['qwen3'], num_draft_layers=2)
    assert t.identity == local.identity                                 # the same weights, wherever they lie
    ids = torch.tensor([[1, 5, 9, 12]])
    assert torch.equal(t(ids), local(ids))
    ds = load_chat_data('acme/chats', t.tokenizer)
    assert len(ds) == 6 and ds.stats.lines == 6


def test_cli_with_hub_ids(hub, tmp_path):
    main(['cache', '--target', 'acme/tiny-qwen3', '--data', 'acme/chats', '--out', str(tmp_path / 'c'),
          '--layers', '1,3', '--no-progress'])
    c = CacheDataset(tmp_path / 'c', 'acme/tiny-qwen3')                # the target named by its hub id
    assert len(c) == 6


def test_published_drafter_by_hub_id(hub, tmp_path):
    cache, _, _ = hub
    _hub_entry(cache, 'model', 'acme/toy-drafter', ROOT / 'dflash' / 'assets' / 'toy-drafter')
    d = DFlashDrafter.from_pretrained('acme/toy-drafter')
    ref = DFlashDrafter.from_pretrained(ROOT / 'dflash' / 'assets' / 'toy-drafter')
    assert all(torch.equal(a, b) for a, b in zip(d.state_dict().values(), ref.state_dict().values()))


@pytest.mark.parametrize('name', ['acme/not-there', 'runs/typo-dir', 'nope'])
def test_missing_id_fails_fast_and_names_where_it_looked(hub, name):
    cache, _, _ = hub
    t0 = time.perf_counter()
    with pytest.raises(FileNotFoundError) as e: TargetFeatures(name)
    dt = time.perf_counter() - t0
    msg = str(e.value)
    assert dt < 5, f"{dt:.1f} s"
    assert f"model '{name}': no such path ({Path(name).absolute()})" in msg
    assert f"not in the local Hugging Face cache (no {cache}/models--{name.replace('/', '--')}/snapshots/main)" in msg
    assert 'nothing is downloaded' in msg


def test_missing_id_cli_fails_fast(hub, tmp_path):
    "The whole command, as a process: a named error in under 5 s of its own run (imports excluded), exit code 2."
    code = ("import time, sys; from dflash.data.command import main; t0 = time.perf_counter()\n"
            "try: main(['cache', '--target', 'acme/not-there', '--data', 'acme/chats', '--out', 'x'])\n"
            "except SystemExit as e: print(f'{time.perf_counter() - t0:.3f}', e.code)")
    env = {**os.environ, 'PYTHONPATH': str(ROOT) + os.pathsep + os.environ.get('PYTHONPATH', '')}
    r = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    secs, rc = r.stdout.split()
    assert float(secs) < 5 and rc == '2'
    assert "model 'acme/not-there': no such path" in r.stderr and 'not in the local Hugging Face cache' in r.stderr


# --- every command, as a process, with the toy target served under a hub id ----------------------------------------
COMMIT = 'c0ffee' + '0' * 34                                       # 40 hex digits, as huggingface_hub names snapshots


@pytest.fixture(scope='module')
def toy_hub(tmp_path_factory):
    "A hub cache holding the shipped toy target as acme/qwen3-toy and the toy drafter as acme/toy-drafter; its env."
    root = tmp_path_factory.mktemp('toy-hub')
    _hub_entry(root / 'hub', 'model', 'acme/qwen3-toy', toy_target_dir(), COMMIT)
    _hub_entry(root / 'hub', 'model', 'acme/toy-drafter', assets_dir() / 'toy-drafter', COMMIT)
    env = {**os.environ, 'HF_HUB_CACHE': str(root / 'hub'), 'HF_HUB_OFFLINE': '1', 'PYTHONUNBUFFERED': '1',
           'HF_DATASETS_CACHE': str(root / 'datasets'), 'OMP_NUM_THREADS': '1', 'TOKENIZERS_PARALLELISM': 'false',
           'PATH': os.pathsep.join([str(Path(sys.executable).parent), os.environ.get('PATH', '')]),
           'PYTHONPATH': os.pathsep.join(filter(None, [str(ROOT), os.environ.get('PYTHONPATH')]))}
    env.pop('HF_HOME', None)
    return env


def _readme_recipe() -> list[str]:
    "The commands of the README's recipe for a target of one's own, continuation lines joined, comments dropped."
    text = (ROOT / 'README.md').read_text().split('## Train a drafter for your own target', 1)[1]
    block = text.split('```bash\n', 1)[1].split('```', 1)[0].replace('\\\n', ' ')
    return [re.sub(r'\s+#.*$', '', line).strip() for line in block.splitlines() if line.strip() and
            not line.lstrip().startswith('#')]


TOY_SIZES = {'regenerate': '--max-new-tokens 16 --batch-size 8 --no-progress',   # toy sizes, in place of the README's
             'synthesize': '--num 2 --max-prompt-tokens 16 --max-new-tokens 8 --batch-size 2 --no-progress',
             'data cache': '--dtype float32 --no-progress',
             'dflash.train': '--max-steps 2 --batch-size 2 --num-anchors 8 --progress-bar false',
             'dflash.speculate': '--num-prompts 2 --max-new-tokens 8 --no-progress'}


def test_readme_recipe_with_a_hub_id(toy_hub, tmp_path):
    """The README's steps for Qwen3-8B, run as written with the toy target served as acme/qwen3-toy from a hand-made
    hub cache (offline): tokenize, regenerate, synthesize, cache, plan, train, evaluate. Only the sizes shrink, one CPU process
    stands for 8 GPUs, and the download is the cache made here."""
    cmds = _readme_recipe()
    assert cmds[0] == 'hf download Qwen/Qwen3-8B' and all('Qwen/Qwen3-8B' in c for c in cmds), cmds
    assert [c.split(' --target')[0].split(' -m ')[-1] for c in cmds[1:]] == [
        'dflash.data tokenize', 'dflash.data regenerate', 'dflash.data synthesize', 'dflash.data cache', 'dflash.plan',
        'dflash.train', 'dflash.speculate'], cmds
    lines = (toy_data_dir() / 'train.jsonl').read_text().splitlines()
    (tmp_path / 'chat.jsonl').write_text('\n'.join(lines[:8]) + '\n')
    held = (toy_data_dir() / 'eval.jsonl').read_text().splitlines()
    (tmp_path / 'held_out.jsonl').write_text('\n'.join(held[:4]) + '\n')
    launcher = shlex.join(launch_commands('x')[0]).split(' -m dflash.train')[0]          # one CPU process
    env = {**toy_hub, 'ACCELERATE_USE_CPU': 'true'}
    for cmd in cmds[1:]:
        cmd = cmd.replace('Qwen/Qwen3-8B', 'acme/qwen3-toy').replace('--num-proc 16', '--num-proc 1')
        cmd = cmd.replace('accelerate launch --multi_gpu --num_processes 8', launcher)
        for k, v in TOY_SIZES.items():                                 # the README's flag replaced where it has one
            if k in cmd: cmd = shlex.join(override(shlex.split(cmd), *v.split()))
        r = subprocess.run(['bash', '-c', cmd], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"{cmd}\n{r.stdout}\n{r.stderr}"
    assert (tmp_path / 'regen.jsonl').is_file() and (tmp_path / 'cache' / 'qwen3-8b' / 'manifest.json').is_file()
    assert len((tmp_path / 'synthetic.jsonl').read_text().splitlines()) == 2
    run = json.loads((tmp_path / 'runs' / 'qwen3-8b' / 'run.json').read_text())
    assert run['status'] == 'finished' and run['config']['target'] == 'acme/qwen3-toy'
    assert (tmp_path / 'runs' / 'qwen3-8b' / 'drafter' / 'model.safetensors').is_file()
    assert 'tau (mean acceptance length)' in r.stdout


def test_speculate_takes_target_and_drafter_by_hub_id(toy_hub, tmp_path):
    r = subprocess.run([sys.executable, '-m', 'dflash.speculate', '--target', 'acme/qwen3-toy', '--drafter',
                        f'acme/toy-drafter@{COMMIT}', '--data', str(toy_data_dir() / 'eval.jsonl'), '--num-prompts',
                        '1', '--max-new-tokens', '8', '--no-progress'], env=toy_hub, cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert 'tau (mean acceptance length)' in r.stdout


MISSING = [
    ('dflash.train', ['--target', 'acme/not-there', '--data', '{data}'], '--target'),
    ('dflash.data', ['tokenize', '--target', 'acme/not-there', '--data', '{data}'], '--target'),
    ('dflash.data', ['cache', '--target', 'acme/not-there', '--data', '{data}', '--out', 'c'], '--target'),
    ('dflash.data', ['regenerate', '--target', 'acme/not-there', '--data', '{data}', '--out', 'r.jsonl'], '--target'),
    ('dflash.data', ['tokenize', '--target', 'acme/qwen3-toy', '--tokenizer', 'acme/not-there', '--data', '{data}'],
     '--tokenizer'),
    ('dflash.speculate', ['--target', 'acme/not-there', '--drafter', 'acme/toy-drafter', '--data', '{data}'],
     '--target'),
    ('dflash.speculate', ['--target', 'acme/qwen3-toy', '--drafter', 'acme/not-there', '--data', '{data}'],
     '--drafter'),
    ('dflash.plan', ['--target-config', 'acme/not-there'], '--target-config')]


@pytest.mark.parametrize('module,argv,option', MISSING, ids=[f"{m.split('.')[1]}-{a[0] if a[0][0] != '-' else ''}"
                                                             f"{o}" for m, a, o in MISSING])
def test_a_hub_id_missing_from_the_cache_fails_fast_in_every_command(toy_hub, tmp_path, module, argv, option):
    "Exit 2, no traceback, the option named with the directory and the cache it looked in, and what to do."
    argv = [a.format(data=toy_data_dir() / 'train.jsonl') for a in argv]
    r = subprocess.run([sys.executable, '-m', module, *argv], env=toy_hub, cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    hub = toy_hub['HF_HUB_CACHE']
    assert r.returncode == 2, r.stdout + r.stderr
    assert 'Traceback' not in r.stderr, r.stderr
    assert f"{option}: model 'acme/not-there': no such path ({tmp_path / 'acme' / 'not-there'})" in r.stderr, r.stderr
    assert f"not in the local Hugging Face cache (no {hub}/models--acme--not-there/snapshots/main)" in r.stderr
    assert 'hf download acme/not-there' in r.stderr


@pytest.mark.parametrize('module,argv', [
    ('dflash.train', ['--target', 'acme/qwen3-toy', '--data', '{data}', '--target-layer-ids', '1', '9']),
    ('dflash.data', ['tokenize', '--target', 'acme/qwen3-toy', '--data', '{data}', '--max-length', '0']),
    ('dflash.data', ['regenerate', '--target', 'acme/qwen3-toy', '--data', '{data}', '--out', 'r.jsonl',
                     '--batch-size', '0']),
    ('dflash.speculate', ['--target', 'acme/qwen3-toy', '--drafter', 'acme/toy-drafter', '--data', '{data}',
                          '--num-prompts', '0']),
    ('dflash.plan', ['--target-config', 'acme/qwen3-toy', '--seq-len', '2048', '--anchors', '0'])],
    ids=['train', 'tokenize', 'regenerate', 'speculate', 'plan'])
def test_option_checks_accept_hub_ids(toy_hub, tmp_path, module, argv):
    "A hub id in the cache passes every command's option checks: the one bad option is the only one named."
    argv = [a.format(data=toy_data_dir() / 'train.jsonl') for a in argv]
    r = subprocess.run([sys.executable, '-m', module, *argv], env=toy_hub, cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and '1 bad option' in r.stderr, r.stdout + r.stderr
    assert 'acme/qwen3-toy' not in r.stderr and 'acme/toy-drafter' not in r.stderr, r.stderr
