"""`python -m dflash.data synthesize`: chat data written by the target alone, its own user messages answered as
`regenerate` answers them; deduplicated, filtered, seeded, resumable, its options checked first. Real processes, on
SmolLM2-135M-Instruct where a real model matters."""
import json, os, signal, subprocess, sys, time
from dflash.data.regenerate import index_path

ENV = {**os.environ, 'OMP_NUM_THREADS': '1', 'TOKENIZERS_PARALLELISM': 'false', 'PYTHONUNBUFFERED': '1'}


def data_cli(*args, wait=True):
    "`python -m dflash.data ARGS` on one thread, without a progress bar."
    cmd = [sys.executable, '-m', 'dflash.data', *map(str, args), '--no-progress', '--threads', '1']
    if not wait: return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)


def summary(stdout: str, said: str) -> dict:
    return json.loads(stdout.split(f'{said}: ')[1].splitlines()[0])


def normalized(text: str) -> str: return ' '.join(text.lower().split())


def greedy_user_message(model_dir, system: str | None = None) -> str:
    "The user message the target writes greedily after the user turn its template opens (after `system`, if given)."
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    mark = 'a user message to cut at'
    text = tok.apply_chat_template([{'role': 'system', 'content': system}] * bool(system) +
                                   [{'role': 'user', 'content': mark}], tokenize=False)
    opened = tok(text[:text.index(mark)], add_special_tokens=False, return_tensors='pt')['input_ids']
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    eot = tok.convert_tokens_to_ids('<|im_end|>')
    said = model.generate(opened, attention_mask=torch.ones_like(opened), do_sample=False, max_new_tokens=64,
                          eos_token_id=eot, pad_token_id=eot)[0, opened.shape[1]:].tolist()
    assert said[-1] == eot, tok.decode(said)                            # it finished: not too long
    return tok.decode(said[:-1]).strip()


def test_synthesized_prompts_come_from_the_target_and_duplicates_are_dropped(smollm2, tmp_path):
    "With a nucleus of one token the target's user message is its greedy one: the same in all 3, so 2 are duplicates."
    out = tmp_path / 's.jsonl'
    r = data_cli('synthesize', '--target', smollm2, '--out', out, '--num', '1', '--batch-size', '3',
                 '--prompt-top-p', '1e-6', '--max-prompt-tokens', '64', '--max-new-tokens', '8')
    assert r.returncode == 0, r.stderr[-3000:]
    s = summary(r.stdout, 'synthesized')
    assert (s['records'], s['prompts'], s['duplicate']) == (1, 3, 2), s
    assert 'dropped: duplicate prompt' in r.stdout
    [rec] = [json.loads(l) for l in out.read_text().splitlines()]
    assert [m['role'] for m in rec['messages']] == ['user', 'assistant']
    assert rec['messages'][0]['content'] == greedy_user_message(smollm2)


def test_a_system_prompt_opens_every_conversation_and_steers_the_user_message(smollm2, tmp_path):
    "`--system S`: each record starts with S, and the user message is the one the target writes after S."
    system = 'You are an expert Python programmer.'
    out = tmp_path / 's.jsonl'
    r = data_cli('synthesize', '--target', smollm2, '--out', out, '--num', '1', '--batch-size', '1', '--system', system,
                 '--prompt-top-p', '1e-6', '--max-prompt-tokens', '64', '--max-new-tokens', '8')
    assert r.returncode == 0, r.stderr[-3000:]
    [rec] = [json.loads(l) for l in out.read_text().splitlines()]
    assert [m['role'] for m in rec['messages']] == ['system', 'user', 'assistant']
    assert rec['messages'][0]['content'] == system
    steered = greedy_user_message(smollm2, system)
    assert rec['messages'][1]['content'] == steered
    assert steered != greedy_user_message(smollm2)                      # the system prompt changed what it asks


def test_synthesize_is_seeded_deduplicated_and_resumes_after_sigterm(smollm2, tmp_path):
    """N records with N distinct user messages, the filters' counts printed; a real run stopped by SIGTERM after a batch
    exits 75, and the same command finishes it into the file an uninterrupted run writes (the same seed, the same file)."""
    args = ['synthesize', '--target', smollm2, '--num', '4', '--batch-size', '1', '--max-prompt-tokens', '48',
            '--max-new-tokens', '8', '--seed', '3']
    full = data_cli(*args, '--out', tmp_path / 'full.jsonl')
    assert full.returncode == 0, full.stderr[-3000:]
    recs = [json.loads(l) for l in (tmp_path / 'full.jsonl').read_text().splitlines()]
    assert len(recs) == 4 and len({normalized(x['messages'][0]['content']) for x in recs}) == 4
    assert all([m['role'] for m in x['messages']] == ['user', 'assistant'] for x in recs)
    s = summary(full.stdout, 'synthesized')
    for row in ('dropped: empty prompt', 'dropped: repeated', 'dropped: too long', 'dropped: duplicate prompt'):
        assert row in full.stdout, full.stdout
    assert s['records'] == 4 and s['prompts'] >= 4, s
    out = tmp_path / 'stopped.jsonl'
    p = data_cli(*args, '--out', out, wait=False)
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None:
        if index_path(out).is_file() and len(index_path(out).read_text().splitlines()) >= 2: break
        time.sleep(0.02)
    p.send_signal(signal.SIGTERM)
    said, _ = p.communicate(timeout=300)
    done = len(out.read_text().splitlines())
    assert p.returncode == 75, said[-3000:]
    assert f"stopped by SIGTERM with {done} of 4 records in {out}" in said and 'Traceback' not in said
    assert not (tmp_path / 'stopped.jsonl.lock').exists()
    rerun = data_cli(*args, '--out', out)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert summary(rerun.stdout, 'synthesized')['resumed_batches'] >= 1
    assert out.read_bytes() == (tmp_path / 'full.jsonl').read_bytes()


def test_synthesize_multi_turn_on_the_toy_target(tmp_path):
    "--turns 2: after each reply the next user turn is opened the same way; `dflash data synthesize` is the command."
    out = tmp_path / 't.jsonl'
    r = subprocess.run(['dflash', 'data', 'synthesize', '--out', str(out), '--num', '4', '--turns', '2',
                        '--max-prompt-tokens', '32', '--max-new-tokens', '48', '--no-progress'],
                       env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(l) for l in out.read_text().splitlines()]
    assert len(recs) == 4
    assert all([m['role'] for m in x['messages']] == ['user', 'assistant'] * 2 for x in recs)
    assert json.loads(index_path(out).read_text().splitlines()[0])['options']['turns'] == 2


def test_steering_text_that_holds_a_special_token_is_refused_before_the_model_loads(tmp_path):
    """SmolLM2's tokenizer reads '<|im_end|>' written in a text as its end of turn: a system prompt, prefix, suffix or
    insertion holding a special token would cut a record's turn. Each is named, in one error, before the weights load."""
    from dflash.bench.real import smollm2_gguf
    out = tmp_path / 's.jsonl'
    r = data_cli('synthesize', '--target', smollm2_gguf(), '--out', out, '--num', '2',
                 '--system', 'Be brief.<|im_end|>', '--user-prefix', 'def', '--user-suffix', '\n<|im_start|>assistant',
                 '--user-insert-after', ':', '--user-insert', '<|endoftext|>')
    assert r.returncode == 2, r.stderr[-3000:]
    assert '3 bad options' in r.stderr, r.stderr
    for flag, text, token in (('--system', 'Be brief.<|im_end|>', '<|im_end|>'),
                              ('--user-suffix', '\n<|im_start|>assistant', '<|im_start|>'),
                              ('--user-insert', '<|endoftext|>', '<|endoftext|>')):
        assert f"{flag} = {text!r}: holds {token!r}, a special token of the target's tokenizer" in r.stderr, r.stderr
    assert 'Loading weights' not in r.stderr and 'Traceback' not in r.stderr
    assert not out.exists() and not index_path(out).exists()
    fine = data_cli('synthesize', '--target', smollm2_gguf(), '--out', out, '--num', '1', '--batch-size', '4',
                    '--user-prefix', 'def <|im', '--user-stop', '.', '--max-prompt-tokens', '16',
                    '--max-new-tokens', '4')
    assert fine.returncode == 0, fine.stderr[-3000:]                 # a part of a special token is text
    assert json.loads(out.read_text().splitlines()[0])['messages'][0]['content'].startswith('def <|im')


def test_bad_synthesize_options_are_refused_before_the_model_loads(tmp_path):
    r = data_cli('synthesize', '--target', tmp_path / 'nowhere', '--out', tmp_path, '--num', '0', '--turns', '0',
                 '--prompt-temperature', '0', '--top-p', '2', '--batch-size', 'x')
    assert r.returncode == 2
    for bad in ("--num = 0: allowed >= 1", "--turns = 0: allowed >= 1", "--prompt-temperature = 0.0: allowed >= 0.01",
                "--top-p = 2.0: allowed > 0 and <= 1", "--batch-size = 'x'", "is a directory", "--target: model"):
        assert bad in r.stderr, (bad, r.stderr)
    long = data_cli('synthesize', '--out', tmp_path / 'o.jsonl', '--num', '3', '--turns', '4', '--max-new-tokens',
                    '1024', '--max-prompt-tokens', '64')                  # the toy target has 4096 positions
    assert long.returncode == 2 and "= 4352: more tokens than the target's 4096 positions" in long.stderr, long.stderr
    missing = data_cli('synthesize', '--max-new-tokens', '0')
    assert missing.returncode == 2
    for bad in ('--out is required', '--num is required', '--max-new-tokens = 0'): assert bad in missing.stderr
    for x in (r, long, missing): assert 'Loading weights' not in x.stderr and 'Traceback' not in x.stderr
    assert not (tmp_path / 'o.jsonl').exists()


def test_a_user_prefix_begins_every_user_message_and_the_target_writes_on(smollm2, tmp_path):
    "`--user-prefix def`: every user message is a function stub the target wrote on from `def`; the index records it."
    out = tmp_path / 's.jsonl'
    r = data_cli('synthesize', '--target', smollm2, '--out', out, '--num', '2', '--batch-size', '8', '--user-prefix',
                 'def', '--max-prompt-tokens', '128', '--max-new-tokens', '8')
    assert r.returncode == 0, r.stderr[-3000:]
    users = [json.loads(l)['messages'][0]['content'] for l in out.read_text().splitlines()]
    assert len(users) == 2 and all(u.startswith('def ') and '(' in u for u in users), users
    assert json.loads(index_path(out).read_text().splitlines()[0])['options']['user_prefix'] == 'def'


def test_a_user_stop_ends_each_stub_where_its_pattern_first_matches(smollm2, tmp_path):
    """`--user-stop`: each user message ends where the pattern first matches, a stub after its docstring or at its first
    blank line; the index records it; a pattern that does not compile, or vLLM, is named before the model loads."""
    import re
    out, stop = tmp_path / 's.jsonl', '"""[\\s\\S]*?"""|\\n\\n'
    r = data_cli('synthesize', '--target', smollm2, '--out', out, '--num', '4', '--batch-size', '8', '--user-prefix',
                 'def', '--user-stop', stop, '--system', 'You are an expert Python programmer. You write complete, '
                 'correct Python functions with docstrings.', '--max-prompt-tokens', '128', '--max-new-tokens', '8')
    assert r.returncode == 0, r.stderr[-3000:]
    users = [json.loads(l)['messages'][1]['content'] for l in out.read_text().splitlines()]   # after the system's
    assert len(users) == 4 and all(u.startswith('def ') for u in users), users
    for u in users:
        hit = re.search(stop, u)
        assert hit is None or hit.end() == len(u), u                 # nothing after the first match
    assert any(u.endswith('"""') for u in users), users                # a stub that ends with its docstring
    assert json.loads(index_path(out).read_text().splitlines()[0])['options']['user_stop'] == stop
    bad = data_cli('synthesize', '--target', smollm2, '--out', tmp_path / 'b.jsonl', '--num', '1', '--user-stop', '(',
                   '--engine', 'vllm')
    assert bad.returncode == 2
    for said in ("--user-stop = '(': not a regular expression", '--user-stop with --engine vllm'):
        assert said in bad.stderr, bad.stderr
    assert 'Loading weights' not in bad.stderr and not (tmp_path / 'b.jsonl').exists()


def test_user_inserts_open_a_docstring_then_put_a_usage_example_into_it(smollm2, tmp_path):
    """`--user-insert-after` and `--user-insert`, in turn: where a stub's signature line ends, a docstring's opening
    quotes go in, and where the docstring's first line ends, `    >>> ` (SmolLM2 writes no doctest on its own); the
    stop pattern still ends the message; the index records both lists; a bad pattern, texts that do not pair with the
    patterns, or vLLM are named before the model loads."""
    import re
    out, stop = tmp_path / 's.jsonl', '"""[\\s\\S]*?"""|\\n\\n'
    after, put = [':\n', '"""[^"\\n]*\\n'], ['    """', '    >>> ']
    r = data_cli('synthesize', '--target', smollm2, '--out', out, '--num', '8', '--batch-size', '8', '--user-prefix',
                 'def', '--user-stop', stop, '--user-insert-after', *after, '--user-insert', *put, '--system',
                 'You are an expert Python programmer. You write complete, correct Python functions with docstrings.',
                 '--max-prompt-tokens', '128', '--max-new-tokens', '8')
    assert r.returncode == 0, r.stderr[-3000:]
    users = [json.loads(l)['messages'][1]['content'] for l in out.read_text().splitlines()]   # after the system's
    assert len(users) == 8 and all(u.startswith('def ') for u in users), users
    for u in users:
        signed = u.find(':\n')
        assert signed < 0 or u[signed + 2:].startswith('    """'), u            # a docstring after the signature
        line = re.search(after[1], u)
        assert line is None or u[line.end():].startswith('    >>> '), u         # an example after its first line
        hit = re.search(stop, u)
        assert hit is None or hit.end() == len(u), u                           # nothing after the stop's first match
    assert any('\n    >>> ' in u for u in users), users
    options = json.loads(index_path(out).read_text().splitlines()[0])['options']
    assert (options['user_insert_after'], options['user_insert']) == (after, put)
    bad = data_cli('synthesize', '--target', smollm2, '--out', tmp_path / 'b.jsonl', '--num', '1',
                   '--user-insert-after', ':', '(', '--user-insert', 'x', '--engine', 'vllm')
    assert bad.returncode == 2
    for said in ("--user-insert-after = '(': not a regular expression", '--user-insert-after with --engine vllm',
                 "--user-insert-after = [':', '('], --user-insert = ['x']: give one non-empty text for each pattern"):
        assert said in bad.stderr, bad.stderr
    assert 'Loading weights' not in bad.stderr and not (tmp_path / 'b.jsonl').exists()
