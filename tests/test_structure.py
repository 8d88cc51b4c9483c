"""Inputs whose structure does not hold, refused in one `error:` line with exit status 2 before anything is written:
a target whose config.json describes another architecture than its weights (cache, train, speculate, regenerate), a
target with fewer positions than --max-length (train, cache), a cache manifest that promises other counts than its
shards hold, and hostile safetensors files (a header length of 100 MB, a header nested 100,000 deep, an entry that is
no tensor's) as a target's weights, a cache shard and a drafter's weights."""
import json, shutil, struct
from pathlib import Path
import pytest
from dflash.core.files import assets_dir, toy_data_dir, toy_target_dir
from dflash.data.command import main as data_main
from dflash.decoding.speculate import main as speculate_main
from dflash.train.command import main as train_main
from conftest import SMALL, override, refused

QUICK = override(SMALL, '--max-steps', '2')


@pytest.fixture(autouse=True)
def _own_caches(tmp_path, monkeypatch):
    "Tokenized data and weights checksums go under tmp_path, not the user's caches."
    monkeypatch.setenv('HF_DATASETS_CACHE', str(tmp_path / 'datasets-cache'))
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'user-cache'))


@pytest.fixture(scope='module')
def data(tmp_path_factory) -> Path:
    "Eight conversations of the toy corpus."
    f = tmp_path_factory.mktemp('data') / 'train.jsonl'
    f.write_text('\n'.join((toy_data_dir() / 'train.jsonl').read_text().splitlines()[:8]) + '\n')
    return f


@pytest.fixture(scope='module')
def cache(tmp_path_factory, data) -> Path:
    "A cache of the toy target over `data`: layers 0, 2, 4, shards of 3, 3 and 2 samples."
    d = tmp_path_factory.mktemp('cache')
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv('HF_DATASETS_CACHE', str(d / 'datasets-cache'))
        mp.setenv('XDG_CACHE_HOME', str(d / 'user-cache'))
        data_main(['cache', '--target', str(toy_target_dir()), '--data', str(data), '--out', str(d / 'cache'),
                   '--layers', '0,2,4', '--shard-size', '3', '--max-length', '128', '--no-progress'])
    return d / 'cache'


def toy_copy(d: Path, **config) -> Path:
    "A copy of the toy target (Qwen3: q_norm and k_norm in every layer) whose config.json has `config`'s fields."
    t = shutil.copytree(toy_target_dir(), d / 'target')
    conf = json.loads((t / 'config.json').read_text())
    (t / 'config.json').write_text(json.dumps({**conf, **config}, indent=1))
    return t


def one_error_line(err: str) -> str:
    "The one `error:` line of a refused command's stderr (transformers' own table of the keys is not printed)."
    lines = [x for x in err.splitlines() if x.startswith('error:')]
    assert len(lines) == 1 and 'LOAD REPORT' not in err, err
    return lines[0]


# --- 1. a config.json over another architecture's weights -----------------------------------------------------------
LLAMA = {'model_type': 'llama', 'architectures': ['LlamaForCausalLM']}
UNPLACED = ("its files hold 12 weights the LlamaForCausalLM of config.json has no place for (like "
            "model.layers.0.self_attn.k_norm.weight, model.layers.0.self_attn.q_norm.weight")


def test_cache_refuses_a_llama_config_over_qwen3_weights(tmp_path, capsys, data):
    out = tmp_path / 'cache'
    err = refused(capsys, data_main, ['cache', '--target', str(toy_copy(tmp_path, **LLAMA)), '--data', str(data),
                                      '--out', str(out), '--max-length', '128', '--no-progress'], UNPLACED)
    assert UNPLACED in one_error_line(err) and not out.exists()


def test_train_refuses_a_llama_config_over_qwen3_weights(tmp_path, capsys, data):
    out = tmp_path / 'run'
    err = refused(capsys, train_main, ['--out', str(out), *override(QUICK, '--target', toy_copy(tmp_path, **LLAMA),
                                                                     '--data', data)], UNPLACED)
    one_error_line(err)
    assert not (out / 'run.json').exists() and not (out / '.lock').exists()


def test_speculate_refuses_a_llama_config_over_qwen3_weights(tmp_path, capsys):
    argv = ['--target', str(toy_copy(tmp_path, **LLAMA)), '--drafter', str(assets_dir() / 'toy-drafter'),
            '--data', str(toy_data_dir() / 'eval.jsonl'), '--num-prompts', '1', '--no-progress']
    err = refused(capsys, speculate_main, argv, UNPLACED)
    one_error_line(err)


def test_regenerate_refuses_a_llama_config_over_qwen3_weights_before_writing(tmp_path, capsys, data):
    out = tmp_path / 'regenerated' / 'out.jsonl'
    err = refused(capsys, data_main, ['regenerate', '--target', str(toy_copy(tmp_path, **LLAMA)), '--data', str(data),
                                      '--out', str(out), '--max-new-tokens', '8', '--no-progress'], UNPLACED)
    one_error_line(err)
    assert not out.parent.exists() or not any(out.parent.iterdir())


# --- 2. a target with fewer positions than --max-length -------------------------------------------------------------
FEW_POSITIONS = "--max-length = 128: allowed <= 64 (the target's max_position_embeddings"


def test_train_refuses_max_length_past_the_targets_positions(tmp_path, capsys, data):
    out = tmp_path / 'run'
    target = toy_copy(tmp_path, max_position_embeddings=64)
    refused(capsys, train_main, ['--out', str(out), *override(QUICK, '--target', target, '--data', data,
                                                               '--max-length', '128')], FEW_POSITIONS)
    assert not out.exists()


def test_cache_refuses_max_length_past_the_targets_positions(tmp_path, capsys, data):
    out = tmp_path / 'cache'
    target = toy_copy(tmp_path, max_position_embeddings=64)
    refused(capsys, data_main, ['cache', '--target', str(target), '--data', str(data), '--out', str(out),
                                '--max-length', '128', '--no-progress'], FEW_POSITIONS)
    assert not out.exists()


# --- 3. a cache manifest that disagrees with its shards -------------------------------------------------------------
def _more_samples(m): return {'num_samples': m['num_samples'] + 40}, "num_samples is 48, but its shards hold 8"
def _more_shards(m): return {'num_shards': 4}, "num_shards is 4, but it records 3 shards"
def _smaller_shards(m): return {'shard_size': 2}, "shard_size is 2, but shard shard-00000.safetensors holds 3 samples"
def _layers_not_a_list(m): return {'layer_ids': 'all'}, "layer_ids is not a list of layers"


@pytest.mark.parametrize('edit', [_more_samples, _more_shards, _smaller_shards, _layers_not_a_list], ids=lambda f: f.__name__[1:])
def test_train_refuses_a_manifest_its_shards_do_not_bear_out(tmp_path, capsys, cache, edit):
    c = shutil.copytree(cache, tmp_path / 'cache')
    manifest = json.loads((c / 'manifest.json').read_text())
    change, said = edit(manifest)
    (c / 'manifest.json').write_text(json.dumps({**manifest, **change}))
    out = tmp_path / 'run'
    err = refused(capsys, train_main, ['--out', str(out), *override(QUICK, '--cache', c)],
                  f"cache {c / 'manifest.json'}: {said}")
    one_error_line(err)
    assert not (out / 'run.json').exists() and not (out / 'metrics.csv').exists()


# --- 4. hostile safetensors headers ---------------------------------------------------------------------------------
HUGE = 100 * 2**20                                                     # a header length field of 100 MB


def hostile(f: Path, kind: str) -> Path:
    """Overwrite `f` with a safetensors file built to hurt its reader: 'huge', a header that claims 100 MB (the file is
    that long, sparse); 'deep', a header of mappings nested 100,000 deep; 'entry', a tensor entry whose data offsets
    are strings."""
    with open(f, 'wb') as out:
        if kind == 'huge':
            out.write(struct.pack('<Q', HUGE))
            out.truncate(8 + HUGE)
            return f
        if kind == 'deep': h = b'{"a":' * 100_000 + b'{}' + b'}' * 100_000
        else: h = json.dumps({'w': {'dtype': 'F32', 'shape': [4], 'data_offsets': ['0', '16']}}).encode()
        out.write(struct.pack('<Q', len(h)) + h + bytes(16))
    return f


SAID = {'huge': "not a safetensors file (safetensors: header too large)",
        'deep': "not a safetensors file (safetensors: invalid JSON in header: recursion limit exceeded",
        'entry': 'not a safetensors file (safetensors: invalid JSON in header: invalid type: string "0", expected usize'}


@pytest.mark.parametrize('kind', ['huge', 'deep', 'entry'])
def test_hostile_target_weights(tmp_path, capsys, data, kind):
    t = toy_copy(tmp_path)
    w = hostile(t / 'model.safetensors', kind)
    out = tmp_path / 'cache'
    err = refused(capsys, data_main, ['cache', '--target', str(t), '--data', str(data), '--out', str(out),
                                      '--max-length', '128', '--no-progress'], f"--target: {w}: {SAID[kind]}")
    assert len(err.strip().splitlines()) <= 2 and not out.exists()             # "N bad options" and the problem


@pytest.mark.parametrize('kind', ['huge', 'deep'])
def test_hostile_cache_shard(tmp_path, capsys, cache, kind):
    c = shutil.copytree(cache, tmp_path / 'cache')
    shard = hostile(c / 'shard-00001.safetensors', kind)
    manifest = json.loads((c / 'manifest.json').read_text())
    manifest['shards'][1]['bytes'] = shard.stat().st_size                   # its size as recorded: only its header lies
    (c / 'manifest.json').write_text(json.dumps(manifest))
    out = tmp_path / 'run'
    err = refused(capsys, train_main, ['--out', str(out), *override(QUICK, '--cache', c)],
                  f"cache {shard}: {SAID[kind]}")
    one_error_line(err)
    assert not (out / 'run.json').exists()


@pytest.mark.parametrize('kind', ['huge', 'deep'])
def test_hostile_drafter_weights(tmp_path, capsys, kind):
    d = shutil.copytree(assets_dir() / 'toy-drafter', tmp_path / 'drafter')
    w = hostile(d / 'model.safetensors', kind)
    refused(capsys, speculate_main, ['--target', str(toy_target_dir()), '--drafter', str(d), '--data',
                                     str(toy_data_dir() / 'eval.jsonl'), '--num-prompts', '1'],
            f"--drafter: {w}: {SAID[kind]}")
