"Hub ids resolve from a hand-made local Hugging Face cache only; a missing one fails fast, naming where it looked."
import json, os, shutil, subprocess, sys, time
from pathlib import Path
import numpy as np
import pytest, torch
from dflash.config import resolve_local
from dflash.features import TargetFeatures, CacheDataset
from dflash.chat import load_chat_data
from dflash.data import main
from dflash.drafter import DFlashDrafter

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
    code = ("import time, sys; from dflash.data import main; t0 = time.perf_counter()\n"
            "try: main(['cache', '--target', 'acme/not-there', '--data', 'acme/chats', '--out', 'x'])\n"
            "except SystemExit as e: print(f'{time.perf_counter() - t0:.3f}', e.code)")
    env = {**os.environ, 'PYTHONPATH': str(ROOT) + os.pathsep + os.environ.get('PYTHONPATH', '')}
    r = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    secs, rc = r.stdout.split()
    assert float(secs) < 5 and rc == '2'
    assert "model 'acme/not-there': no such path" in r.stderr and 'not in the local Hugging Face cache' in r.stderr
