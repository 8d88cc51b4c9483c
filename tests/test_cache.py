"The offline hidden-state cache: equality with online features, resume after an interruption, corrupt input."
import json, os, signal, subprocess, sys, time
from pathlib import Path
import numpy as np
import pytest, torch
from conftest import chat_sentence
import dflash.data.cache as features
from dflash.data.chat import collate
from dflash.data.cache import CacheDataset, write_cache
from dflash.data.features import TargetFeatures
from dflash.data.chat import ChatDataset
from dflash.data.command import main

ROOT = Path(__file__).resolve().parents[1]


def _jsonl(path, n, seed=0, turns=2):
    rng = np.random.default_rng(seed)
    with open(path, 'w') as f:
        for _ in range(n):
            msgs = []
            for _ in range(turns):
                msgs += [{'role': 'user', 'content': chat_sentence(rng)},
                         {'role': 'assistant', 'content': chat_sentence(rng)}]
            f.write(json.dumps({'messages': msgs}) + '\n')
    return path


def _files(d):
    "{name: bytes} of every file of a directory."
    return {p.name: p.read_bytes() for p in sorted(Path(d).iterdir())}


@pytest.mark.parametrize('name, dtype', [('qwen3', torch.float32), ('llama', torch.bfloat16)])
def test_cache_equals_online_bit_for_bit(tmp_path, chat_targets, name, dtype):
    t = TargetFeatures(chat_targets[name], num_draft_layers=3, dtype=dtype)
    ds = ChatDataset.from_jsonl(_jsonl(tmp_path / 'd.jsonl', 5), t.tokenizer)
    man = write_cache(t, ds, tmp_path / 'cache', shard_size=2, progress=False)
    assert (man['num_samples'], len(man['shards']), man['dtype'], man['layer_ids']) == (5, 3, str(dtype)[6:], [1, 2, 3])
    cache = CacheDataset(tmp_path / 'cache', t)
    assert len(cache) == 5
    for i in range(5):
        c, s = cache[i], ds[i]
        assert torch.equal(c['input_ids'], s['input_ids']) and torch.equal(c['loss_mask'], s['loss_mask'])
        online = t(s['input_ids'][None])[0]                                         # (S, 3·H)
        assert c['context'].dtype == dtype and torch.equal(c['context'], online)
    b = collate([cache[3], cache[1]])
    L = len(ds[1]['input_ids'])
    assert torch.equal(b['context'][1, :L], t(ds[1]['input_ids'][None])[0]) and not b['context'][1, L:].any()


def test_killed_writer_resumes_to_the_same_cache(tmp_path, chat_targets):
    "A real `python -m dflash.data cache` killed with SIGKILL after its first shard, then run again."
    data_file = _jsonl(tmp_path / 'd.jsonl', 24, seed=1)
    args = ['cache', '--target', str(chat_targets['qwen3']), '--data', str(data_file), '--layers', '1,4',
            '--shard-size', '1', '--no-progress']
    main(args + ['--out', str(tmp_path / 'whole')])
    out = tmp_path / 'killed'
    env = {**os.environ, 'PYTHONPATH': str(ROOT) + os.pathsep + os.environ.get('PYTHONPATH', '')}
    proc = subprocess.Popen([sys.executable, '-m', 'dflash.data', *args, '--out', str(out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        try: shards = json.loads((out / 'manifest.json').read_text())['shards']
        except (FileNotFoundError, json.JSONDecodeError): shards = []
        if shards: break
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, f"the writer ended before it was killed: {err.decode()[-500:]}"
    partial = json.loads((out / 'manifest.json').read_text())
    assert not partial['complete'] and 1 <= len(partial['shards']) < 24
    with pytest.raises(ValueError, match=r'incomplete, \d+ of 24 shards written; rerun the cache command'):
        CacheDataset(out)
    main(args + ['--out', str(out)])                                                # the same command again
    assert _files(out) == _files(tmp_path / 'whole')


def test_failed_writer_resumes_without_redoing_shards(tmp_path, chat_targets, monkeypatch):
    t = TargetFeatures(chat_targets['llama'], num_draft_layers=2)
    ds = ChatDataset.from_jsonl(_jsonl(tmp_path / 'd.jsonl', 7, seed=2), t.tokenizer)
    write_cache(t, ds, tmp_path / 'whole', shard_size=2, progress=False)
    real, calls = features._write_shard, []
    def failing(path, tensors):
        calls.append(path.name)
        if len(calls) == 3: raise KeyboardInterrupt                               # dies while writing the third shard
        return real(path, tensors)
    monkeypatch.setattr(features, '_write_shard', failing)
    with pytest.raises(KeyboardInterrupt): write_cache(t, ds, tmp_path / 'cache', shard_size=2, progress=False)
    calls.clear()
    write_cache(t, ds, tmp_path / 'cache', shard_size=2, progress=False)
    assert calls == ['shard-00002.safetensors', 'shard-00003.safetensors']        # finished shards are not redone
    assert _files(tmp_path / 'cache') == _files(tmp_path / 'whole')


@pytest.fixture
def small_cache(tmp_path, chat_targets):
    t = TargetFeatures(chat_targets['qwen3'], num_draft_layers=2)
    ds = ChatDataset.from_jsonl(_jsonl(tmp_path / 'd.jsonl', 4, seed=3), t.tokenizer)
    write_cache(t, ds, tmp_path / 'cache', shard_size=2, progress=False)
    return t, ds, tmp_path / 'cache'


def test_corrupt_shard_is_named(small_cache):
    _, _, cache = small_cache
    shard = cache / 'shard-00001.safetensors'
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    shard.write_bytes(raw)
    ds = CacheDataset(cache)
    ds[0]                                                                            # shard 0 is intact
    with pytest.raises(ValueError, match='shard shard-00001.safetensors is corrupt'): ds[3]


def test_truncated_or_missing_shard_is_named(small_cache):
    _, _, cache = small_cache
    shard = cache / 'shard-00001.safetensors'
    shard.write_bytes(shard.read_bytes()[:-7])
    msg = r'shard shard-00001.safetensors is truncated or corrupt \(\d+ bytes, the manifest says'
    with pytest.raises(ValueError, match=msg):
        CacheDataset(cache)
    shard.unlink()
    with pytest.raises(ValueError, match='shard shard-00001.safetensors is missing'): CacheDataset(cache)
    (cache / 'manifest.json').write_text('{"format": ')
    with pytest.raises(ValueError, match='unreadable manifest'): CacheDataset(cache)
    (cache / 'manifest.json').unlink()
    with pytest.raises(FileNotFoundError, match='no manifest.json, not a dflash cache'): CacheDataset(cache)


def test_cache_of_another_target_names_both(small_cache, chat_targets):
    t, ds, cache = small_cache
    other = TargetFeatures(chat_targets['llama'], num_draft_layers=2)
    with pytest.raises(ValueError) as e: CacheDataset(cache, other)
    assert t.identity in str(e.value) and other.identity in str(e.value) and t.identity != other.identity
    assert CacheDataset(cache, chat_targets['qwen3']).manifest['target']['identity'] == t.identity  # a path works too
    with pytest.raises(ValueError) as e: write_cache(other, ds, cache, shard_size=2, progress=False)  # no silent mix
    assert f"holds a cache of target {t.identity}" in str(e.value) and other.identity in str(e.value)
    with pytest.raises(ValueError, match='holds a cache of other data'):
        write_cache(t, ChatDataset([ds[i] for i in (1, 0, 2, 3)]), cache, shard_size=2, progress=False)


def test_cli_bad_input(tmp_path, chat_targets, capsys):
    f = _jsonl(tmp_path / 'd.jsonl', 3, seed=4)
    f.write_text(f.read_text() + '{"messages": [{"role": "user", "content": "yes"}]}\n{"chat": []}\n')
    args = ['cache', '--target', str(chat_targets['qwen3']), '--data', str(f), '--out', str(tmp_path / 'c'),
            '--no-progress']
    with pytest.raises(SystemExit) as e: main(args)
    assert e.value.code == 2 and "d.jsonl:5: no 'messages' or 'conversations' key" in capsys.readouterr().err
    main(args + ['--skip-bad-lines'])
    stats = CacheDataset(tmp_path / 'c').stats
    assert (stats.samples, stats.bad_lines, stats.no_supervised) == (3, 1, 1)
    with pytest.raises(SystemExit):
        main(['cache', '--target', str(tmp_path / 'nope'), '--data', str(f), '--out', str(tmp_path / 'x')])
    assert "nope': no such path" in capsys.readouterr().err


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as e: main(['cache', '--help'])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith('usage: python -m dflash.data cache')
    for opt in ('--target', '--data', '--out', '--layers', '--max-length', '--shard-size', '--skip-bad-lines'):
        assert opt in out


def _port():
    import socket
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return str(s.getsockname()[1])


def _launch_cache(processes, *args, env_extra):
    "`accelerate launch [--multi_gpu --num_processes N] -m dflash.data cache ...` on CPU (gloo when N > 1)."
    dist = ['--multi_gpu', '--num_processes', str(processes)] if processes > 1 else ['--cpu', '--num_processes', '1']
    cmd = [sys.executable, '-m', 'accelerate.commands.launch', *dist, '--num_machines', '1', '--mixed_precision', 'no',
           '--dynamo_backend', 'no', '--main_process_port', _port(), '-m', 'dflash.data', 'cache', *args]
    env = {**os.environ, 'OMP_NUM_THREADS': '1', **env_extra,
           'PYTHONPATH': str(ROOT) + os.pathsep + os.environ.get('PYTHONPATH', '')}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


def test_two_processes_write_the_same_cache_as_one(tmp_path, chat_targets):
    "Shards split over 2 gloo processes: byte-identical to 1 process; the data is tokenized once, by the main process."
    data_file = _jsonl(tmp_path / 'd.jsonl', 11, seed=5)
    with open(data_file, 'a') as f:                                   # equal-length samples, to share forwards
        for _ in range(4): f.write(json.dumps({'messages': [{'role': 'user', 'content': 'the cat'},
                                                            {'role': 'assistant', 'content': 'the dog runs'}]}) + '\n')
    args = ['--target', str(chat_targets['qwen3']), '--data', str(data_file), '--layers', '1,4', '--shard-size', '3',
            '--no-progress']
    env = {'HF_DATASETS_CACHE': str(tmp_path / 'tok')}
    _launch_cache(1, *args, '--out', str(tmp_path / 'one'), env_extra=env)
    tokenized = sorted((tmp_path / 'tok' / 'dflash-tokenized').iterdir())
    two = _launch_cache(2, *args, '--out', str(tmp_path / 'two'),
                        env_extra={'HF_DATASETS_CACHE': str(tmp_path / 'tok2')})
    assert _files(tmp_path / 'two') == _files(tmp_path / 'one') and len(_files(tmp_path / 'one')) == 1 + 2 * 5
    assert len(list((tmp_path / 'tok2' / 'dflash-tokenized').iterdir())) == 1 and two.stderr.count('  read ') == 1
    t = TargetFeatures(chat_targets['qwen3'], layer_ids=[1, 4])
    cache, ds = CacheDataset(tmp_path / 'two', t), ChatDataset.from_jsonl(data_file, t.tokenizer)
    for i in range(len(ds)): assert torch.equal(cache[i]['context'], t(ds[i]['input_ids'][None])[0])
    assert len(tokenized) == 1


@pytest.mark.parametrize('argv', [['--help'], ['cache', '--help'], ['tokenize', '--help']])
def test_help_answers_before_torch_loads(argv):
    "`python -m dflash.data [cmd] --help` imports neither torch, transformers' models nor datasets."
    r = subprocess.run([sys.executable, '-X', 'importtime', '-m', 'dflash.data', *argv], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.startswith('usage: python -m dflash.data'), r.stderr[-2000:]
    loaded = {line.rsplit('|', 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith('import time:')}
    assert not {'torch', 'datasets', 'transformers.models'} & loaded, sorted(loaded)


# --- stopped by a signal: after the shard in progress, resumed to the same cache ------------------------------------
@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT], ids=['SIGTERM', 'SIGINT'])
@pytest.mark.parametrize('after', [1, 3])
def test_signal_stops_after_the_shard_in_progress(tmp_path, chat_targets, monkeypatch, signum, after):
    "A real signal while shard `after` is written: that shard is finished and recorded, then the writer stops."
    from dflash.core.stops import StopRequest
    from dflash.core.errors import Preempted
    t = TargetFeatures(chat_targets['llama'], num_draft_layers=2)
    ds = ChatDataset.from_jsonl(_jsonl(tmp_path / 'd.jsonl', 9, seed=4), t.tokenizer)
    write_cache(t, ds, tmp_path / 'whole', shard_size=2, progress=False)
    real, calls, sent = features._write_shard, [], []
    def signalled(path, tensors):
        calls.append(path.name)
        if len(calls) == after and not sent: sent.append(os.kill(os.getpid(), signum))   # once, mid-write
        return real(path, tensors)
    monkeypatch.setattr(features, '_write_shard', signalled)
    with StopRequest() as stop, pytest.raises(Preempted) as e:
        write_cache(t, ds, tmp_path / 'cache', shard_size=2, progress=False, stop=stop)
    name = signal.Signals(signum).name
    assert str(e.value).startswith(f"stopped by {name} with {after} of 5 shards in {tmp_path / 'cache'}"), str(e.value)
    partial = json.loads((tmp_path / 'cache' / 'manifest.json').read_text())
    assert len(partial['shards']) == after and not partial.get('complete')
    assert not [p for p in (tmp_path / 'cache').glob('.*')], "no temporary file left"
    calls.clear()
    write_cache(t, ds, tmp_path / 'cache', shard_size=2, progress=False)
    assert len(calls) == 5 - after and _files(tmp_path / 'cache') == _files(tmp_path / 'whole')


def test_sigterm_to_the_cache_command_exits_75(tmp_path, chat_targets):
    "`python -m dflash.data cache` given SIGTERM after its first shard: status 75, the count on stderr, resumable."
    data_file = _jsonl(tmp_path / 'd.jsonl', 24, seed=1)
    args = ['cache', '--target', str(chat_targets['qwen3']), '--data', str(data_file), '--layers', '1,4',
            '--shard-size', '1', '--no-progress']
    out = tmp_path / 'stopped'
    env = {**os.environ, 'PYTHONPATH': str(ROOT) + os.pathsep + os.environ.get('PYTHONPATH', '')}
    proc = subprocess.Popen([sys.executable, '-m', 'dflash.data', *args, '--out', str(out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not list(out.glob('shard-*.json')): time.sleep(0.002)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-2000:]
    done = len(json.loads((out / 'manifest.json').read_text())['shards'])
    assert f"stopped by SIGTERM with {done} of 24 shards in {out}; run the same command again" in err, err[-2000:]
    assert 'Traceback' not in err and 1 <= done < 24
    main(args + ['--out', str(out)])
    main(args + ['--out', str(tmp_path / 'whole')])
    assert _files(out) == _files(tmp_path / 'whole')
