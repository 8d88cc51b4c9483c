"""Regeneration of chat data by the target: batched against unbatched, killed and rerun, 1 and 2 processes, refusals;
prompts without replies answered, replies cut at the token limit marked (and their false end of turn unsupervised)."""
import json, os, signal, socket, subprocess, sys, time
import pytest, torch
from dflash.data.generate import TransformersEngine, load_conversations, regenerate_batch
from dflash.data.regenerate import index_path, regenerate, vllm_unavailable
from dflash.core.schema import RegenConfig
from dflash.data.templates import end_of_turn_ids, prompt_ids
from dflash.data.toy import load_toy_target
from dflash.core.files import toy_data_dir

ENV = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONUNBUFFERED': '1'}


@pytest.fixture(autouse=True)
def _one_thread():
    "The toy target's matrices are tiny: one thread, which never waits on a busy second core."
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def small_data(tmp_path):
    "The first 12 held-out toy conversations (one to three assistant turns each)."
    p = tmp_path / 'in.jsonl'
    p.write_text(''.join(l + '\n' for l in (toy_data_dir() / 'eval.jsonl').read_text().splitlines()[:12]))
    return p


def cli(*args, wait=True):
    cmd = [sys.executable, '-m', 'dflash.regenerate', '--no-progress', *map(str, args)]
    if not wait: return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)


def wait_for_batches(p, out, n: int):
    "Until the regeneration `p` writing `out` has indexed `n` batches (the index's header line besides), or has ended."
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None:
        if index_path(out).is_file() and len(index_path(out).read_text().splitlines()) >= n + 1: return
        time.sleep(0.02)


def test_batched_equals_unbatched_greedy(small_data):
    "Left-padded batches with the KV cache give, token for token, what one-at-a-time greedy generate gives (float64)."
    model, tok = load_toy_target(dtype=torch.float64)
    stops = end_of_turn_ids(tok, model.generation_config)
    convs = [m for _, m in load_conversations(small_data)[0]]
    got, info = regenerate_batch(TransformersEngine(model, stops, max_new_tokens=40), tok, convs)
    assert info['turns'] > len(convs)                      # some conversations have later turns
    for n, msgs in enumerate(convs):
        msgs, ref = [dict(m) for m in msgs], []
        for i, m in enumerate(msgs):
            if m['role'] != 'assistant': continue
            ids = torch.tensor([prompt_ids(tok, msgs[:i], {})])           # earlier turns: the regenerated ones
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=40,
                                 eos_token_id=stops, pad_token_id=tok.pad_token_id)
            new = out[0, ids.shape[1]:].tolist()
            end = next((k for k, t in enumerate(new) if t in stops), None)      # cut before the first stop
            toks, stopped = new[:end], end is not None
            m['content'] = tok.decode(toks, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            if not stopped: m['truncated'] = True                           # cut at the limit: marked
            ref.append(toks)
        assert info['token_ids'][n] == ref, n
        assert got[n] == msgs, n
        assert [m for m in got[n] if m['role'] != 'assistant'] == [m for m in convs[n] if m['role'] != 'assistant']


def test_sampling_is_seeded(small_data, tmp_path):
    "Sampling draws the same text for the same seed and other text for another seed."
    kw = dict(data=str(small_data), batch_size=4, max_new_tokens=24, temperature=1.0, top_p=0.9, progress=False)
    texts = []
    for name, seed in (('a', 1), ('b', 1), ('c', 2)):
        regenerate(RegenConfig(out=str(tmp_path / f'{name}.jsonl'), seed=seed, **kw))
        texts.append((tmp_path / f'{name}.jsonl').read_text())
    assert texts[0] == texts[1] and texts[0] != texts[2]


def test_killed_run_reruns_to_the_same_file(small_data, tmp_path):
    "A real process killed mid-file (plus a half-written line), then rerun, writes the uninterrupted run's file."
    args = ['--data', small_data, '--batch-size', '2', '--max-new-tokens', '32']
    full = cli(*args, '--out', tmp_path / 'full.jsonl')
    assert full.returncode == 0, full.stderr
    out = tmp_path / 'killed.jsonl'
    p = cli(*args, '--out', out, wait=False)
    wait_for_batches(p, out, 2)
    p.send_signal(signal.SIGKILL)
    p.wait()
    finished = len(index_path(out).read_text().splitlines()) - 1
    assert 2 <= finished < 6, finished                     # killed mid-file: 6 batches in all
    with open(out, 'a') as f: f.write('{"messages": [{"role": "us')     # what a kill inside a write leaves
    rerun = cli(*args, '--out', out)
    assert rerun.returncode == 0, rerun.stderr
    r = json.loads(rerun.stdout.split('regenerated: ')[1])
    assert r['resumed_batches'] == finished and r['regenerated'] == 12 - 2 * finished
    assert out.read_bytes() == (tmp_path / 'full.jsonl').read_bytes()
    again = cli(*args, '--out', out)                       # finished: nothing to do, nothing changed
    assert json.loads(again.stdout.split('regenerated: ')[1])['regenerated'] == 0
    assert out.read_bytes() == (tmp_path / 'full.jsonl').read_bytes()


def _port() -> str:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return str(s.getsockname()[1])


def test_two_processes_write_the_file_of_one(small_data, tmp_path):
    "Under accelerate launch the batches are split over 2 processes; the output is byte for byte the 1-process file."
    args = ['--data', small_data, '--batch-size', '3', '--max-new-tokens', '32', '--no-progress']
    one = cli(*args[:-1], '--out', tmp_path / 'one.jsonl')
    assert one.returncode == 0, one.stderr
    cmd = [sys.executable, '-m', 'accelerate.commands.launch', '--multi_gpu', '--num_processes', '2',
           '--num_machines', '1', '--mixed_precision', 'no', '--dynamo_backend', 'no', '--main_process_port', _port(),
           '-m', 'dflash.regenerate', *map(str, args), '--out', str(tmp_path / 'two.jsonl')]
    two = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    assert (tmp_path / 'two.jsonl').read_bytes() == (tmp_path / 'one.jsonl').read_bytes()
    assert two.stdout.count("regenerated: ") == 1                     # one report, from the main process


def test_data_command_dispatches_to_regenerate(small_data, tmp_path):
    "`python -m dflash.data regenerate` is the same command."
    r = subprocess.run([sys.executable, '-m', 'dflash.data', 'regenerate', '--data', str(small_data), '--out',
                        str(tmp_path / 'o.jsonl'), '--batch-size', '12', '--max-new-tokens', '8', '--no-progress'],
                       env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert len((tmp_path / 'o.jsonl').read_text().splitlines()) == 12


@pytest.mark.skipif(vllm_unavailable() is None, reason='vLLM and a GPU are here: the engine runs instead')
def test_vllm_refused_with_the_reason(small_data, tmp_path):
    r = cli('--data', small_data, '--out', tmp_path / 'o.jsonl', '--engine', 'vllm')
    assert r.returncode == 2 and f"engine vllm: {vllm_unavailable()}" in r.stderr, r.stderr
    assert 'Loading weights' not in r.stderr and not (tmp_path / 'o.jsonl').exists()


@pytest.mark.skipif(vllm_unavailable() is not None, reason=f'vLLM engine: {vllm_unavailable()}')
def test_vllm_matches_transformers_greedy(small_data, tmp_path):
    "Where vLLM runs: its greedy regeneration of the toy corpus in float32 matches the transformers engine's turns."
    kw = dict(data=str(small_data), batch_size=12, max_new_tokens=32, dtype='float32', progress=False)
    regenerate(RegenConfig(out=str(tmp_path / 'hf.jsonl'), **kw))
    regenerate(RegenConfig(out=str(tmp_path / 'vllm.jsonl'), engine='vllm', **kw))
    hf, vl = [(tmp_path / f).read_text().splitlines() for f in ('hf.jsonl', 'vllm.jsonl')]
    same = sum(a == b for a, b in zip(hf, vl))
    assert same >= 0.9 * len(hf), (same, len(hf))          # float32 kernels differ; near-ties may flip a turn


def test_bad_options_and_lines_fail_before_loading(small_data, tmp_path):
    r = cli('--data', tmp_path / 'none.jsonl', '--out', tmp_path / 'o.jsonl', '--batch-size', '0', '--top-p', '2',
            '--thinking', 'maybe', '--engine', 'tpu')
    assert r.returncode == 2
    for bad in ("none.jsonl': no such path", '--batch-size = 0', '--top-p = 2.0', "--thinking = 'maybe'",
                "--engine = 'tpu'"):
        assert bad in r.stderr, (bad, r.stderr)
    assert 'Loading weights' not in r.stderr
    bad = tmp_path / 'bad.jsonl'
    bad.write_text(small_data.read_text().splitlines()[0] + '\n{"messages": [{"role": "user", "content": "x"}\n')
    r = cli('--data', bad, '--out', tmp_path / 'o.jsonl')
    assert r.returncode == 2 and f'{bad}:2: malformed JSON line' in r.stderr and 'Loading weights' not in r.stderr
    with pytest.raises(ValueError, match='no enable_thinking switch'):   # the toy template has no thinking switch
        regenerate(RegenConfig(data=str(small_data), out=str(tmp_path / 'o.jsonl'), thinking='off', progress=False))


def test_rerun_with_other_options_is_refused(small_data, tmp_path):
    out = tmp_path / 'o.jsonl'
    regenerate(RegenConfig(data=str(small_data), out=str(out), batch_size=12, max_new_tokens=8, progress=False))
    with pytest.raises(ValueError, match='other options'):
        regenerate(RegenConfig(data=str(small_data), out=str(out), batch_size=12, max_new_tokens=9, progress=False))
    foreign = tmp_path / 'foreign.jsonl'
    foreign.write_text('{"messages": []}\n')
    with pytest.raises(ValueError, match='not written by this command'):
        regenerate(RegenConfig(data=str(small_data), out=str(foreign), progress=False))


def test_second_regeneration_into_one_out_is_refused(small_data, tmp_path, capsys):
    "A regeneration holds `OUT.lock` while it writes: another one into the same --out is refused, naming the holder."
    from dflash.data.regenerate import main
    out, lock = tmp_path / 'o.jsonl', tmp_path / 'o.jsonl.lock'
    argv = ['--data', str(small_data), '--out', str(out), '--batch-size', '12', '--max-new-tokens', '4', '--no-progress']
    holder = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
    try:
        lock.write_text(json.dumps({'pid': holder.pid, 'host': socket.gethostname(), 'started': 'now'}))
        with pytest.raises(SystemExit) as e: main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"error: --out {out} is in use by process {holder.pid}" in err, err
        assert not out.exists() and not index_path(out).exists() and lock.is_file(), "the holder's output is left alone"
    finally:
        holder.kill()
        holder.wait()
    main(argv)                                                     # its holder gone: the stale lock is taken over
    assert 'taking over its stale lock' in capsys.readouterr().out
    assert out.is_file() and not lock.exists()


# --- stopped by a signal: after the batch in progress, rerun to the same file ---------------------------------------
@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT], ids=['SIGTERM', 'SIGINT'])
@pytest.mark.parametrize('after', [1, 4])
def test_signal_stops_after_the_batch_in_progress(small_data, tmp_path, monkeypatch, signum, after):
    "A real signal while batch `after` is appended: that batch is finished and indexed, then regeneration stops."
    import dflash.data.regenerate as R
    from dflash.core.stops import StopRequest
    from dflash.core.errors import Preempted
    kw = dict(data=str(small_data), batch_size=2, max_new_tokens=16, progress=False)
    regenerate(RegenConfig(out=str(tmp_path / 'full.jsonl'), **kw))
    real, calls, sent = R.append_batch, [], []
    def signalled(out, entry, records):
        calls.append(entry['batch'])
        if len(calls) == after and not sent: sent.append(os.kill(os.getpid(), signum))   # once, mid-write
        return real(out, entry, records)
    monkeypatch.setattr(R, 'append_batch', signalled)
    out = tmp_path / 'o.jsonl'
    with StopRequest() as stop, pytest.raises(Preempted) as e: regenerate(RegenConfig(out=str(out), **kw), stop)
    name = signal.Signals(signum).name
    assert str(e.value) == (f"stopped by {name} with {2 * after} of 12 conversations in {out}; run the same command "
                            "again to continue")
    assert len(out.read_text().splitlines()) == 2 * after and out.read_text().endswith('\n')
    assert len(index_path(out).read_text().splitlines()) == 1 + after
    calls.clear()
    r = regenerate(RegenConfig(out=str(out), **kw))
    assert (r['resumed_batches'], calls) == (after, list(range(after, 6)))
    assert out.read_bytes() == (tmp_path / 'full.jsonl').read_bytes()


def test_sigterm_to_the_command_exits_75_and_releases_the_lock(small_data, tmp_path):
    "A real `python -m dflash.regenerate` given SIGTERM mid-file: status 75, a whole-record file, no lock left."
    args = ['--data', small_data, '--batch-size', '1', '--max-new-tokens', '32']
    out = tmp_path / 'o.jsonl'
    p = cli(*args, '--out', out, wait=False)
    wait_for_batches(p, out, 1)
    p.send_signal(signal.SIGTERM)
    said, _ = p.communicate(timeout=300)
    done = len(out.read_text().splitlines())
    assert p.returncode == 75, said[-2000:]
    assert f"stopped by SIGTERM with {done} of 12 conversations in {out}" in said and 'Traceback' not in said
    assert 1 <= done < 12 and out.read_text().endswith('\n') and not (tmp_path / 'o.jsonl.lock').exists()
    rerun = cli(*args, '--out', out)
    assert rerun.returncode == 0, rerun.stderr
    assert json.loads(rerun.stdout.split('regenerated: ')[1])['resumed_batches'] == done
    full = cli(*args, '--out', tmp_path / 'full.jsonl')
    assert out.read_bytes() == (tmp_path / 'full.jsonl').read_bytes(), full.stderr


# --- prompts without replies, and truncation marks (SmolLM2) ----------------------------------------------------------
def data_cli(*args):
    "`python -m dflash.data ARGS` on one thread, without a progress bar."
    cmd = [sys.executable, '-m', 'dflash.data', *map(str, args), '--no-progress', '--threads', '1']
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)


PROMPTS = [
    {'messages': [{'role': 'user', 'content': 'Is the sky blue? Answer with one word.'}]},
    {'messages': [{'role': 'system', 'content': 'You are a poet.'},
                  {'role': 'user', 'content': 'Write a long poem about the sea.'}]},
    {'messages': [{'role': 'user', 'content': 'Hi!'}, {'role': 'assistant', 'content': 'an old reply'}]},
    {'messages': [{'role': 'system', 'content': 'Nothing to answer here.'}]},
]


@pytest.fixture(scope='module')
def regenerated(smollm2, tmp_path_factory):
    "`data regenerate` of PROMPTS on SmolLM2 with 12 new tokens at most: (the run, the records written)."
    d = tmp_path_factory.mktemp('regen')
    (d / 'in.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in PROMPTS))
    r = data_cli('regenerate', '--target', smollm2, '--data', d / 'in.jsonl', '--out', d / 'out.jsonl',
                 '--max-new-tokens', '12', '--batch-size', '4')
    assert r.returncode == 0, r.stderr[-3000:]
    return r, [json.loads(l) for l in (d / 'out.jsonl').read_text().splitlines()]


def test_regenerate_answers_prompt_only_records(regenerated):
    r, recs = regenerated
    assert [[m['role'] for m in x['messages']] for x in recs] == [
        ['user', 'assistant'], ['system', 'user', 'assistant'], ['user', 'assistant'], ['system']]
    assert all(x['messages'][-1]['content'].strip() for x in recs[:3])
    assert recs[2]['messages'][1]['content'] != 'an old reply' and recs[3] == PROMPTS[3]
    s = json.loads(r.stdout.split('regenerated: ')[1])
    marks = sum(m.get('truncated', False) for x in recs for m in x['messages'])
    assert (s['appended'], s['turns'], s['truncated_replies']) == (2, 3, marks), s
    assert recs[1]['messages'][-1].get('truncated') is True             # a long poem in 12 tokens: cut, and marked


def test_truncated_reply_end_of_turn_is_not_in_the_loss_mask(regenerated, smollm2):
    "A truncated reply's tokens are supervised and the <|im_end|> the template appends after it is not; a finished one's is."
    from dflash.data.records import to_messages
    from dflash.data.templates import load_tokenizer, tokenize_chat
    tok = load_tokenizer(smollm2)
    eot = tok.convert_tokens_to_ids('<|im_end|>')
    _, recs = regenerated
    kinds = set()
    for rec in recs[:3]:
        msgs = to_messages(rec)
        reply = msgs[-1]
        ids, mask = (t.tolist() for t in tokenize_chat(tok, msgs))
        start = max(i for i in range(len(ids)) if mask[i] and (i == 0 or not mask[i - 1]))   # the last reply's run
        end = start
        while end < len(ids) and mask[end]: end += 1
        if reply.get('truncated'):
            assert tok.decode(ids[start:end]) == reply["content"] and ids[end] == eot      # <|im_end|> after it
        else:
            assert ids[end - 1] == eot and tok.decode(ids[start:end - 1]) == reply['content'].strip()
        kinds.add(bool(reply.get('truncated')))
    assert kinds == {True, False}, recs                                  # both kinds were seen


def test_nothing_to_regenerate_is_an_error_before_the_model_loads(tmp_path):
    data, out = tmp_path / 'sys.jsonl', tmp_path / 'o.jsonl'
    data.write_text('{"messages": [{"role": "system", "content": "Be brief."}]}\n{"messages": []}\n')
    r = data_cli('regenerate', '--data', data, '--out', out)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"error: {data}: nothing to regenerate: none of its 2 conversations"), r.stderr
    assert 'Traceback' not in r.stderr and 'Loading weights' not in r.stderr
    assert not out.exists() and not index_path(out).exists() and not (tmp_path / 'o.jsonl.lock').exists()



# --- a tokenizer without a pad token (Llama 3's has none): batching must not change a reply ----------------------------
@pytest.fixture(scope='module')
def padless_llama(chat_bpe, tmp_path_factory):
    "A small random Llama saved with a Llama 3 template tokenizer that has no pad token."
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from conftest import LLAMA3
    d = tmp_path_factory.mktemp('padless')
    tok = PreTrainedTokenizerFast(tokenizer_object=chat_bpe, bos_token='<|begin_of_text|>', eos_token='<|eot_id|>')
    tok.chat_template = LLAMA3
    assert tok.pad_token_id is None
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=448, bos_token_id=tok.bos_token_id,
                                 eos_token_id=tok.eos_token_id, pad_token_id=None)).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def padless_records(n_words=(1, 2, 12, 3, 7, 1)) -> list[dict]:
    "Chat records whose first prompts differ in length (batches are padded); the second ends on a user turn."
    import numpy as np
    from conftest import chat_sentence
    rng = np.random.default_rng(1)
    recs = []
    for n in n_words:
        msgs = [{'role': 'user', 'content': chat_sentence(rng, n)}, {'role': 'assistant', 'content': 'old'}]
        recs.append({'messages': msgs[:1] if n == 2 else msgs})
    return recs


def test_padless_engine_batched_equals_unbatched(padless_llama):
    "The engine needs no pad token: with a tokenizer that has none, batched = one at a time, and no stop id written."
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(padless_llama)
    model = AutoModelForCausalLM.from_pretrained(padless_llama, dtype=torch.float64).eval()
    stops = end_of_turn_ids(tok, model.generation_config)
    prompts = [prompt_ids(tok, r['messages'][:1], {}) for r in padless_records()]
    assert tok.pad_token_id is None and len({len(p) for p in prompts}) > 1
    eng = TransformersEngine(model, stops, max_new_tokens=12)
    got = eng(prompts)
    assert got == [eng([p])[0] for p in prompts]
    assert all(not set(t) & set(stops) for t, _ in got)                 # a reply ends before its stop id


def test_padless_tokenizer_batched_equals_unbatched(padless_llama, tmp_path):
    "`data regenerate` with a tokenizer without a pad token writes the same records with --batch-size 1, 2 and 3."
    recs = padless_records()
    data = tmp_path / 'in.jsonl'
    data.write_text(''.join(json.dumps(r) + '\n' for r in recs))
    outs = {}
    for b in (1, 2, 3):
        out = tmp_path / f'b{b}.jsonl'
        r = data_cli('regenerate', '--target', padless_llama, '--data', data, '--out', out, '--batch-size', b,
                     '--max-new-tokens', '6', '--dtype', 'float64')
        assert r.returncode == 0, r.stderr[-3000:]
        outs[b] = [json.loads(l) for l in out.read_text().splitlines()]
    assert len(outs[1]) == len(recs) and all(x['messages'][-1]['content'] != 'old' for x in outs[1])
    assert outs[2] == outs[1] and outs[3] == outs[1]


# --- --cache: the target's hidden states, grown with the file ---------------------------------------------------------
@pytest.fixture
def own_caches(tmp_path, monkeypatch):
    "Tokenized data and weights checksums of the in-process commands go under tmp_path, not the user's caches."
    monkeypatch.setenv('HF_DATASETS_CACHE', str(tmp_path / 'datasets-cache'))
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'user-cache'))


def same_cache(grown, written):
    """The cache `grown` with its data holds what the cache `written` afterwards holds: the same samples, the same
    tokens and loss masks up to each grown sample's end (nothing supervised past it), features (and final hidden
    states, where both keep them) within float rounding."""
    from dflash.data.cache import CacheDataset
    a, b = CacheDataset(grown), CacheDataset(written)
    assert len(a) == len(b) > 0 and a.layer_ids == b.layer_ids, (len(a), len(b), a.layer_ids, b.layer_ids)
    for i in range(len(a)):
        n = len(a[i]['input_ids'])
        assert torch.equal(a[i]['input_ids'], b[i]['input_ids'][:n]), i
        assert torch.equal(a[i]['loss_mask'], b[i]['loss_mask'][:n]) and not b[i]['loss_mask'][n:].any(), i
        for k in ('context', 'final_hidden') if a.manifest['final_hidden'] else ('context',):
            x, y = a[i][k].float(), b[i][k][:n].float()                      # a float64 run's cache holds float64
            assert torch.allclose(x, y, atol=1e-4), (i, k, (x - y).abs().max())


def test_regenerate_cache_is_the_cache_commands_and_trains(small_data, tmp_path, own_caches):
    """`regenerate --cache --final-hidden` writes the cache `data cache --final-hidden` writes of the file afterwards;
    `dflash.train --cache` trains on it, distilling the target's distribution (`--loss tv`)."""
    from dflash.core.files import toy_target_dir
    from dflash.data.command import main as data_main
    from dflash.train.command import main as train_main
    out, grown = tmp_path / 'o.jsonl', tmp_path / 'grown'
    r = data_cli('regenerate', '--data', small_data, '--out', out, '--batch-size', '5', '--max-new-tokens', '24',
                 '--cache', grown, '--num-draft-layers', '2', '--final-hidden')
    assert r.returncode == 0, r.stderr[-3000:]
    said = json.loads(r.stdout.split('regenerated: ')[1])['cache']
    assert (said['samples'], said['left_out_now']) == (12, 0), said
    manifest = json.loads((grown / 'manifest.json').read_text())
    assert (manifest['data']['batches'], manifest['num_shards'], manifest['data']['path']) == (3, 3, str(out))
    assert manifest['final_hidden'] is True
    data_main(['cache', '--target', str(toy_target_dir()), '--data', str(out), '--out', str(tmp_path / 'after'),
               '--num-draft-layers', '2', '--no-progress', '--threads', '1', '--final-hidden'])
    same_cache(grown, tmp_path / 'after')
    after = json.loads((tmp_path / 'after' / 'manifest.json').read_text())
    assert manifest['data']['chat_template'] == after['data']['chat_template'] is not None   # the template's hash
    import csv
    from conftest import SMALL, override
    run = tmp_path / 'run'
    train_main(['--out', str(run), '--cache', str(grown), *override(SMALL, '--max-steps', '2', '--report-to', 'none',
                                                                     '--loss', 'tv')])
    steps = [int(row['step']) for row in csv.DictReader((run / 'metrics.csv').read_text().splitlines())]
    assert max(steps) == 2, steps
    assert (run / 'drafter' / 'model.safetensors').is_file()


def test_max_repeat_cuts_each_reply_at_its_first_repeat(small_data, tmp_path, own_caches):
    """`--max-repeat 3` ends each reply where it first repeats 3 tokens: a first reply is the uncut one up to there,
    marked truncated; its cache is the one `data cache` writes of the file; a rerun with another --max-repeat is
    refused (float64: the batch's rows leave at other steps, and no rounding may flip a token)."""
    from dflash.core.files import toy_target_dir
    from dflash.data.command import main as data_main
    kw = dict(data=str(small_data), batch_size=4, max_new_tokens=40, dtype='float64', progress=False)
    regenerate(RegenConfig(out=str(tmp_path / 'full.jsonl'), **kw))
    out, grown = tmp_path / 'cut.jsonl', tmp_path / 'grown'
    regenerate(RegenConfig(out=str(out), max_repeat=3, cache=str(grown), num_draft_layers=2, **kw))
    first = lambda f: [next(m for m in json.loads(l)['messages'] if m['role'] == 'assistant')
                       for l in f.read_text().splitlines()]
    cut = 0
    for a, b in zip(first(tmp_path / 'full.jsonl'), first(out)):
        assert a['content'].startswith(b['content']), (a, b)
        if b['content'] != a['content']: cut += 1
        if b['content'] != a['content']: assert b.get('truncated'), b
    assert cut > 0                                                         # the toy target repeats itself
    data_main(['cache', '--target', str(toy_target_dir()), '--data', str(out), '--out', str(tmp_path / 'after'),
               '--num-draft-layers', '2', '--no-progress', '--threads', '1'])
    same_cache(grown, tmp_path / 'after')
    with pytest.raises(Exception, match='max_repeat'): regenerate(RegenConfig(out=str(out), max_repeat=4, **kw))


def test_a_stopped_regeneration_continues_its_cache(small_data, tmp_path, monkeypatch):
    """Stopped by SIGTERM after its first batch, then killed between a batch's cache and its file (the cache a batch
    ahead), a regeneration with --cache run again ends with the file and the cache of an uninterrupted run."""
    import dflash.data.regenerate as R
    from dflash.core.errors import Preempted
    from dflash.core.stops import StopRequest
    data = tmp_path / 'in.jsonl'
    data.write_text(''.join(small_data.read_text().splitlines(keepends=True)[:6]))
    kw = dict(data=str(data), batch_size=2, max_new_tokens=16, num_draft_layers=2, progress=False)
    full = regenerate(RegenConfig(out=str(tmp_path / 'full.jsonl'), cache=str(tmp_path / 'full-cache'), **kw))
    out, cache = tmp_path / 'o.jsonl', tmp_path / 'cache'
    cfg = RegenConfig(out=str(out), cache=str(cache), **kw)
    real = R.append_batch
    batches = lambda: (len(index_path(out).read_text().splitlines()) - 1,
                       json.loads((cache / 'manifest.json').read_text())['data']['batches'])
    def signalled(o, entry, records):
        if entry['batch'] == 0: os.kill(os.getpid(), signal.SIGTERM)      # while batch 0 is appended: finished, then stop
        return real(o, entry, records)
    monkeypatch.setattr(R, 'append_batch', signalled)
    with StopRequest() as stop, pytest.raises(Preempted): regenerate(cfg, stop)
    assert batches() == (1, 1)
    def killed(o, entry, records):
        raise RuntimeError('killed')                                       # after the cache, before the file
    monkeypatch.setattr(R, 'append_batch', killed)
    with pytest.raises(RuntimeError, match='killed'): regenerate(cfg)
    assert batches() == (1, 2)                                             # the cache one batch ahead of the file
    monkeypatch.setattr(R, 'append_batch', real)
    r = regenerate(cfg)
    assert (r['resumed_batches'], r['regenerated'], r['cache']['samples']) == (1, 4, full['cache']['samples'])
    assert out.read_bytes() == (tmp_path / 'full.jsonl').read_bytes()
    same_cache(cache, tmp_path / 'full-cache')
    fm, m = (json.loads((d / 'manifest.json').read_text()) for d in (tmp_path / 'full-cache', cache))
    assert {k: m[k] for k in ('num_samples', 'num_tokens', 'num_shards')} == \
           {k: fm[k] for k in ('num_samples', 'num_tokens', 'num_shards')} and m['data']['batches'] == 3


def test_cache_option_errors_come_together_before_the_target_loads(small_data, tmp_path, capsys, monkeypatch):
    import dflash.data.regenerate as R
    from dflash.data.command import main as data_main
    from conftest import refused
    grown = tmp_path / 'grown'                                             # the cache of another file
    regenerate(RegenConfig(data=str(small_data), out=str(tmp_path / 'first.jsonl'), cache=str(grown), batch_size=6,
                           max_new_tokens=4, num_draft_layers=2, progress=False))
    monkeypatch.setattr(R, 'make_engine', lambda *a: pytest.fail('the target loaded'))
    run = ['regenerate', '--data', str(small_data), '--no-progress', '--threads', '1']
    a_file = tmp_path / 'a-file'
    a_file.write_text('')
    err = refused(capsys, data_main, [*run, '--out', str(tmp_path / 'o.jsonl'), '--cache', str(a_file), '--engine',
                                      'vllm', '--batch-size', '0'],
                  f"--cache = {str(a_file)!r}: is a file, expected a directory",
                  "--cache with --engine vllm: the cache is read off transformers' forwards; use --engine transformers, "
                  "or write the cache afterwards with `python -m dflash.data cache`", '--batch-size = 0: allowed >= 1')
    assert 'bad options' in err
    refused(capsys, data_main, [*run, '--out', str(tmp_path / 'o.jsonl'), '--num-draft-layers', '2'],
            '--num-draft-layers = 2: read only with --cache (the layers it holds); leave it out, or give --cache')
    refused(capsys, data_main, [*run, '--out', str(tmp_path / 'o.jsonl'), '--cache', str(tmp_path / 'c'),
                                '--num-draft-layers', '7'], "--num-draft-layers = 7: more than the target's 6 layers")
    refused(capsys, data_main, [*run, '--out', str(tmp_path / 'o.jsonl'), '--cache', str(grown), '--num-draft-layers',
                                '2', '--batch-size', '6'], f"--cache {grown}: holds 2 batches and {tmp_path / 'o.jsonl'} 0")
    assert not (tmp_path / 'o.jsonl').exists() and not (tmp_path / 'c').exists()
