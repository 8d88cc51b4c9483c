"Speculative decoding with the trained toy drafter: lossless, and its tau agrees with the training-time estimate."
import csv, json, os, signal, subprocess, sys, time
import pytest, torch
from dflash.model.config import DrafterConfig
from dflash.model.drafter import DFlashDrafter
from dflash.model.layout import BlockLayout
from dflash.model.objective import dflash_objective
from dflash.data.chat import ChatDataset
from dflash.data.chat import collate
from dflash.data.features import TargetFeatures
from dflash.decoding.loop import speculative_generate, greedy_generate
from dflash.decoding.evaluate import eval_prompts, acceptance_eval
from dflash.decoding.speculate import main as speculate_main
from dflash.data.toy import load_toy_target
from dflash.core.files import assets_dir, toy_data_dir, toy_target_dir
from conftest import refused

ENV = {**os.environ, 'OMP_NUM_THREADS': '1', 'TOKENIZERS_PARALLELISM': 'false'}


@pytest.fixture(scope='module')
def toy():
    torch.set_num_threads(1)
    target, tok = load_toy_target()
    drafter = DFlashDrafter.from_pretrained(assets_dir() / 'toy-drafter').eval()
    return target, tok, drafter


@pytest.mark.parametrize('block_size', [2, 4, 16])
def test_trained_drafter_is_lossless(toy, block_size):
    target, tok, drafter = toy
    prompts = eval_prompts(toy_data_dir() / 'eval.jsonl', tok, 6)
    accepted = []
    for p in prompts:
        spec = speculative_generate(target, drafter, p, max_new_tokens=48, block_size=block_size,
                                    stop_token_ids=[tok.eos_token_id])
        assert spec.tokens == greedy_generate(target, p, 48, [tok.eos_token_id])
        assert sum(spec.acceptance) == len(spec.tokens) - 1
        accepted += spec.acceptance
    assert max(accepted) > 1, "the trained drafter gets drafts accepted, so the multi-token path is exercised"


def test_sampling_is_reproducible(toy):
    "Speculative sampling with a seeded generator: the same seed gives the same tokens, another seed others."
    target, tok, drafter = toy
    p = eval_prompts(toy_data_dir() / 'eval.jsonl', tok, 1)[0]
    def run(seed):
        return speculative_generate(target, drafter, p, max_new_tokens=48, temperature=1., top_p=0.9,
                                    generator=torch.Generator().manual_seed(seed)).tokens
    assert run(0) == run(0) and run(0) != run(1)


def test_argmax_draft_rule(toy):
    """--draft-rule argmax: greedy's tokens at T = 0 as before; at T = 1 it runs, counts accepted argmax drafts, and
    is reported; a rule that is neither is refused, by the loop and by the command's options."""
    from dflash.core.errors import OptionsError
    from dflash.core.options import parse_options
    from dflash.core.schema import SpeculateOptions
    target, tok, drafter = toy
    eos = [tok.eos_token_id]
    prompts = eval_prompts(toy_data_dir() / 'eval.jsonl', tok, 3)
    for p in prompts:
        spec = speculative_generate(target, drafter, p, max_new_tokens=32, stop_token_ids=eos, draft_rule='argmax')
        assert spec.tokens == greedy_generate(target, p, 32, eos)
    r = acceptance_eval(target, drafter, prompts, max_new_tokens=32, stop_token_ids=eos, temperature=1.,
                        draft_rule='argmax')
    assert r['draft_rule'] == 'argmax' and r['tau'] > 1 and sum(r['histogram']) == r['steps'], r
    with pytest.raises(ValueError, match='not one of sample, argmax'):
        speculative_generate(target, drafter, prompts[0], temperature=1., draft_rule='mode')
    assert parse_options(SpeculateOptions, ['--draft-rule', 'argmax'])[0].draft_rule == 'argmax'
    with pytest.raises(OptionsError, match='draft-rule'): parse_options(SpeculateOptions, ['--draft-rule', 'mode'])


def test_tau_agrees_with_training_time_estimate(toy):
    "The loop's tau and the objective's tau estimate on the same held-out conversations agree within 15%."
    target, tok, drafter = toy
    n = 48
    prompts = eval_prompts(toy_data_dir() / 'eval.jsonl', tok, n)
    spec = acceptance_eval(target, drafter, prompts, max_new_tokens=128, stop_token_ids=[tok.eos_token_id])
    feats = TargetFeatures(toy_target_dir(), layer_ids=drafter.config.target_layer_ids, device='cpu')
    data = ChatDataset.from_jsonl(toy_data_dir() / 'eval.jsonl', tok, max_length=512)
    total = None
    with torch.no_grad():
        for i in range(0, n, 8):
            b = collate([data[j] for j in range(i, min(i + 8, n))], pad_token_id=tok.pad_token_id)
            lay = BlockLayout.from_batch(b['input_ids'], b['loss_mask'], mask_token_id=drafter.config.mask_token_id,
                                         block_size=drafter.config.block_size, num_anchors=64,
                                         sample_ids=b['sample_ids'])
            s = dflash_objective(drafter(feats(b['input_ids'], b['attention_mask']), lay, feats.embed_weight),
                                 lay, feats.lm_head_weight)
            total = s if total is None else total + s
    est = total.tau.item()
    assert spec['tau'] > 2, spec
    assert abs(spec['tau'] - est) <= 0.15 * est, (spec['tau'], est)


def spec_cli(*args, **kw):
    "`python -m dflash.speculate` on the toy target and its trained drafter, with `args` after."
    cmd = [sys.executable, '-m', 'dflash.speculate', '--target', str(toy_target_dir()), '--drafter',
           str(assets_dir() / 'toy-drafter'), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600, **kw)


def read_rows(out) -> list[dict]:
    with open(out / 'prompts.csv', newline='') as f: return list(csv.DictReader(f))


def test_command_line(tmp_path):
    """`python -m dflash.speculate` as a real process on the toy target and drafter: it runs, prints a running total
    after each prompt, and writes its report, with a CSV row per prompt and temperature timing every method."""
    out = tmp_path / 'spec'
    run = spec_cli('--data', toy_data_dir() / 'eval.jsonl', '--num-prompts', '3', '--max-new-tokens', '16',
                   '--out', out)
    assert run.returncode == 0, run.stderr
    report = json.loads((out / 'acceptance.json').read_text())
    assert [r['temperature'] for r in report['runs']] == [0, 1], report          # greedy and T = 1 by default
    assert (report['partial'], report['done'], report['total'], report['prompt_lookup_num_tokens']) == (False, 6, 6, 10)
    for r in report['runs']:
        assert r['tau'] >= 1 and sum(r['histogram']) == r['steps'] and r['speedup'] > 0 and r['speedup_cpu'] > 0, r
    greedy, sampled = report['runs']
    assert (greedy['same_output'], greedy['mismatches'], greedy['lookup_same_output']) == (3, [], 3), greedy
    assert greedy['speedup_vs_lookup'] > 0 and 'lookup_s' not in sampled and 'same_output' not in sampled, sampled
    assert (out / 'acceptance.png').is_file()
    rows = read_rows(out)
    assert [(r['temperature'], r['prompt']) for r in rows] == [(t, str(i)) for t in ('0.0', '1.0') for i in range(3)]
    for r in rows:
        assert all(float(r[k]) > 0 for k in ('spec_s', 'spec_cpu_s', 'plain_s', 'plain_cpu_s')), r
        assert (r['lookup_s'] != '', r['same_output']) == ((True, 'True') if r['temperature'] == '0.0' else (False, ''))
    assert sum(int(r['new_tokens']) for r in rows[:3]) == greedy['tokens']
    for t in ('0', '1'):                                      # the running total, prompt by prompt
        assert [f'T={t} {i}/3 prompts: tau ' in run.stdout for i in (1, 2, 3)] == [True] * 3, run.stdout
    assert 'same tokens as plain greedy: speculative 3/3, prompt lookup 3/3' in run.stdout, run.stdout


@pytest.fixture
def logged_calls(monkeypatch):
    "The decoders `acceptance_eval` calls, in the order it calls them."
    import dflash.decoding.evaluate as S
    calls = []
    for name, label in [('speculative_generate', 'speculative'), ('greedy_generate', 'plain'),
                        ('sample_generate', 'plain'), ('lookup_generate', 'lookup')]:
        monkeypatch.setattr(S, name, lambda *a, _f=getattr(S, name), _l=label, **kw: calls.append(_l) or _f(*a, **kw))
    return calls


def test_each_prompt_is_decoded_by_every_method_in_turn(toy, logged_calls):
    "Prompt by prompt: speculative, plain, then prompt lookup (T = 0 only), each prompt's record timing all of them."
    target, tok, drafter = toy
    prompts = eval_prompts(toy_data_dir() / 'eval.jsonl', tok, 4)
    rows = []
    kw = dict(max_new_tokens=12, stop_token_ids=[tok.eos_token_id], baseline=True, lookup_tokens=5,
              on_prompt=lambda row, totals: rows.append((row, totals['prompts'])))
    greedy, sampled = acceptance_eval(target, drafter, prompts, **kw), \
        acceptance_eval(target, drafter, prompts, temperature=1., **kw)
    assert logged_calls == ['speculative', 'plain', 'lookup'] * 4 + ['speculative', 'plain'] * 4, logged_calls
    assert [(r['temperature'], r['prompt'], n) for r, n in rows] == [(t, i, i + 1) for t in (0, 1) for i in range(4)]
    assert all(r['lookup_s'] > 0 and r['lookup_same_output'] for r, _ in rows[:4])
    assert not any('lookup_s' in r for r, _ in rows[4:])
    assert greedy['same_output'] == 4 and sampled['prompts'] == 4 and 'same_output' not in sampled


def test_same_output_check_names_the_prompts_that_differ(toy, monkeypatch):
    "A plain decoder that gets prompts 1 and 3 wrong: two mismatches, listed, for speculative and prompt lookup alike."
    import dflash.decoding.evaluate as S
    target, tok, drafter = toy
    prompts = eval_prompts(toy_data_dir() / 'eval.jsonl', tok, 4)
    right, calls = S.greedy_generate, []
    def wrong_at_odd_prompts(*args):
        tokens = right(*args)
        calls.append(args)
        return tokens[:-1] + [tokens[-1] + 1] if len(calls) % 2 == 0 else tokens
    monkeypatch.setattr(S, 'greedy_generate', wrong_at_odd_prompts)
    r = acceptance_eval(target, drafter, prompts, max_new_tokens=12, stop_token_ids=[tok.eos_token_id], baseline=True,
                        lookup_tokens=5)
    assert (r['same_output'], r['mismatches'], r['lookup_same_output'], r['lookup_mismatches']) == (2, [1, 3], 2, [1, 3])


def test_sigterm_keeps_the_results_so_far(tmp_path):
    """A real SIGTERM to a running `python -m dflash.speculate`: it stops between two prompts, prints and writes the
    results so far, marked partial with the count done, and exits 75."""
    out = tmp_path / 'spec'
    cmd = [sys.executable, '-m', 'dflash.speculate', '--target', str(toy_target_dir()), '--drafter',
           str(assets_dir() / 'toy-drafter'), '--data', str(toy_data_dir() / 'eval.jsonl'), '--num-prompts', '40',
           '--max-new-tokens', '64', '--out', str(out)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None:          # until the first two prompts are in the CSV
        if (out / 'prompts.csv').is_file() and len((out / 'prompts.csv').read_text().splitlines()) >= 3: break
        time.sleep(0.02)
    p.send_signal(signal.SIGTERM)
    said, err = p.communicate(timeout=300)
    assert p.returncode == 75, err[-3000:]
    report, rows = json.loads((out / 'acceptance.json').read_text()), read_rows(out)
    assert report['partial'] and report['stopped_by'] == 'SIGTERM', report
    assert 2 <= report['done'] == len(rows) < report['total'] == 80, (report['done'], len(rows))
    assert sum(r['prompts'] for r in report['runs']) == report['done'] and (out / 'acceptance.png').is_file()
    assert [r['prompt'] for r in rows] == [str(i) for i in range(len(rows))]
    assert f"stopped by SIGTERM after {report['done']} of 80 prompt runs (40 prompts x 2 temperatures)" in err, err
    assert 'Traceback' not in err and f"partial: stopped by SIGTERM after {report['done']} of 80" in said


def test_prompt_only_records(toy, tmp_path):
    """A record without an assistant turn prompts with all its turns; one with, with the turns before the first; one
    that opens with the assistant is passed over. The command runs on a file of prompts only."""
    target, tok, drafter = toy
    u, a = (lambda text: {'role': 'user', 'content': text}), (lambda text: {'role': 'assistant', 'content': text})
    recs = [{'messages': [u('the red cat')]}, {'messages': [a('hello'), u('the dog')]},
            {'messages': [{'role': 'system', 'content': 'be brief'}, u('a tree'), a('yes'), u('why')]},
            {'messages': [u('the blue house'), u('and the river')]}]
    data = tmp_path / 'prompts.jsonl'
    data.write_text(''.join(json.dumps(r) + '\n' for r in recs))
    render = lambda turns: tok.apply_chat_template(turns, add_generation_prompt=True, return_dict=True)['input_ids']
    expect = [render(recs[0]['messages']), render(recs[2]['messages'][:2]), render(recs[3]['messages'])]
    assert [p[0].tolist() for p in eval_prompts(data, tok)] == expect
    only = tmp_path / 'only.jsonl'
    only.write_text(''.join(json.dumps(r) + '\n' for r in (recs[0], recs[3])))
    r = speculate_main(['--target', str(toy_target_dir()), '--drafter', str(assets_dir() / 'toy-drafter'),
                        '--data', str(only), '--max-new-tokens', '16', '--temperature', '0', '--threads', '1',
                        '--no-progress'])
    assert (r['prompts'], r['runs'][0]['same_output']) == (2, 2), r


@pytest.mark.parametrize('lines,expect', [
    ([], 'nothing to prompt with (0 records, none with a user turn;'),
    ([{'messages': [{'role': 'assistant', 'content': 'hello'}]}] * 2, 'nothing to prompt with (2 records, none with a user turn;'),
    (['{"messages": [{"role": "us'], ':1: malformed JSON line'),
    ([{'prompt': 'the cat'}], ":1: no 'messages' or 'conversations' key")], ids=['empty', 'no-prompt', 'torn', 'no-chat'])
def test_data_without_a_prompt_is_named(tmp_path, capsys, lines, expect):
    "A data file with nothing to prompt with: one error naming it, with the other bad options, before any model loads."
    data = tmp_path / 'd.jsonl'
    data.write_text(''.join((x if isinstance(x, str) else json.dumps(x)) + '\n' for x in lines))
    err = refused(capsys, speculate_main, ['--target', str(toy_target_dir()), '--drafter',
                                           str(assets_dir() / 'toy-drafter'), '--data', str(data), '--top-p', '2'],
                  '2 bad options', f"--data: {data}", expect, "--top-p = 2.0")
    assert err.count('\n  ') == 2, err                       # the option check's one error: before the models load


def test_tied_embeddings_smollm2_greedy_is_exact(smollm2, tmp_path):
    """SmolLM2-135M-Instruct ties its input embedding and LM head (one tensor): the drafter embeds its block and
    scores its drafts with that tensor, and speculative decoding at T = 0 gives plain greedy's tokens, prompt for
    prompt, with an untrained drafter (whose drafts are rejected: the verify path and the cache cropping decide)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    target = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(smollm2)
    weight = target.get_input_embeddings().weight
    assert weight is target.get_output_embeddings().weight and target.config.tie_word_embeddings
    mask = tok.convert_tokens_to_ids('<empty_output>')
    torch.manual_seed(0)
    drafter = DFlashDrafter(DrafterConfig.from_target(target.config, mask_token_id=mask, num_hidden_layers=1,
                                                      block_size=4)).eval()
    seen = []
    draft_block = drafter.draft_block
    drafter.draft_block = lambda ctx, block, embed, cache=None: seen.append(embed) or draft_block(ctx, block, embed, cache)
    questions = ['What is the capital of France?', 'Name three colours.', 'Write a haiku about the sea.']
    for q in questions:
        ids = torch.tensor([tok.apply_chat_template([{'role': 'user', 'content': q}], add_generation_prompt=True,
                                                    return_dict=True)['input_ids']])
        assert mask not in ids[0].tolist()
        spec = speculative_generate(target, drafter, ids, max_new_tokens=16, stop_token_ids=[tok.eos_token_id])
        assert spec.tokens == greedy_generate(target, ids, 16, [tok.eos_token_id]), q
    assert seen and all(e.weight is weight and e.scale == 1 for e in seen)      # the tied tensor, as Llama embeds it
    del drafter.draft_block
    drafter.save_pretrained(tmp_path / 'drafter')
    data = tmp_path / 'q.jsonl'
    data.write_text(''.join(json.dumps({'messages': [{'role': 'user', 'content': q}]}) + '\n' for q in questions))
    r = speculate_main(['--target', str(smollm2), '--drafter', str(tmp_path / 'drafter'), '--data', str(data),
                        '--num-prompts', '2', '--max-new-tokens', '16', '--temperature', '0', '--threads', '1',
                        '--no-progress'])                                    # the command, on prompt-only records
    x = r['runs'][0]
    assert (x['prompts'], x['same_output'], x['mismatches'], x['lookup_same_output']) == (2, 2, [], 2), x


def test_histogram_keeps_its_labels():
    "The acceptance plot's x label lies inside the saved figure (it was cut off before)."
    from dflash.decoding.evaluate import plot_acceptance
    ax = plot_acceptance([5, 3, 2, 1], title='tau = 1.82')
    fig = ax.figure
    fig.canvas.draw()
    box = ax.xaxis.label.get_window_extent()
    assert box.y0 >= 0 and box.x0 >= 0 and box.x1 <= fig.bbox.x1, (box, fig.bbox)


@pytest.mark.parametrize('module', ['dflash.speculate', 'dflash.plan'])
def test_help_answers_before_torch_loads(module):
    "`--help` prints every option with its default without importing torch or transformers' models."
    r = subprocess.run([sys.executable, '-X', 'importtime', '-m', module, '--help'], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.startswith(f'usage: python -m {module}'), r.stderr[-2000:]
    loaded = {line.rsplit('|', 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith('import time:')}
    assert not {'torch', 'transformers.models', 'matplotlib'} & loaded, sorted(loaded)
    assert r.stdout.count('(default: ') <= r.stdout.count('\n  --'), 'one default per option at most'


def test_a_draft_vocabulary_drafts_through_d2t_and_stays_lossless(toy, tmp_path):
    "The toy drafter over the quarter of the vocabulary most often supervised: exported, reloaded, still lossless."
    from dataclasses import replace
    from dflash.model.objective import draft_vocab, token_counts
    target, tok, drafter = toy
    V = drafter.config.vocab_size
    ids = draft_vocab(token_counts([ChatDataset.from_jsonl(toy_data_dir() / 'train.jsonl', tok, 256)], V)[1], V // 4)
    small = DFlashDrafter(replace(drafter.config, draft_vocab_size=len(ids)))
    assert sorted(small.load_state_dict(drafter.state_dict(), strict=False).missing_keys) == ['d2t', 'lm_head.weight', 't2d']
    small.set_draft_vocab(ids, target.get_output_embeddings().weight)
    small.save_pretrained(tmp_path / 'small')
    small = DFlashDrafter.from_pretrained(tmp_path / 'small').eval()
    accepted = []
    for p in eval_prompts(toy_data_dir() / 'eval.jsonl', tok, 6):
        spec = speculative_generate(target, small, p, max_new_tokens=48, stop_token_ids=[tok.eos_token_id])
        assert spec.tokens == greedy_generate(target, p, 48, [tok.eos_token_id])
        accepted += spec.acceptance
    assert max(accepted) > 1, "drafts mapped back by d2t are accepted"


@pytest.mark.parametrize('argv,expect', [
    (['--copy-ngram', '4', '--draft-confidence', '0'], '--copy-ngram = 4: read only with --draft-confidence above 0'),
    (['--copy-ngram', '-1'], '--copy-ngram'), (['--copy-ngram', '1.5'], '--copy-ngram'),
    (['--copy-ngram', 'four'], '--copy-ngram')], ids=['whole-block', 'negative', 'fraction', 'word'])
def test_a_copy_ngram_that_cannot_act_is_refused(tmp_path, capsys, argv, expect):
    "A negative, fractional or worded --copy-ngram, or one with the whole block verified (no copy outruns it): refused."
    refused(capsys, speculate_main, ['--target', str(toy_target_dir()), '--drafter', str(assets_dir() / 'toy-drafter'),
                                     '--data', str(toy_data_dir() / 'eval.jsonl'), '--out', str(tmp_path / 'o'), *argv],
            expect)
    assert not (tmp_path / 'o').exists()


def test_copies_from_the_context_keep_smollm2_greedy(smollm2, tmp_path):
    """The committed SmolLM2 drafter on two function stubs whose replies restate them: with copies from the context
    (`--copy-ngram`, the CPU default), some steps verify a copy, and the tokens are plain greedy's."""
    from pathlib import Path
    stubs = ['def add(a: int, b: int) -> int:\n    """Return the sum of a and b.\n    >>> add(2, 3)\n    5\n    """\n',
             'def is_even(n: int) -> bool:\n    """Return True when n is even.\n    >>> is_even(4)\n    True\n    """\n']
    data = tmp_path / 'stubs.jsonl'
    data.write_text(''.join(json.dumps({'messages': [{'role': 'user', 'content': s}]}) + '\n' for s in stubs))
    drafter = Path(__file__).parents[1] / 'benchmarks' / 'real' / 'drafter'
    r = speculate_main(['--target', str(smollm2), '--drafter', str(drafter), '--data', str(data), '--num-prompts', '2',
                        '--max-new-tokens', '48', '--temperature', '0', '--draft-confidence', '0.3', '--copy-ngram', '4',
                        '--threads', '1', '--no-progress', '--out', str(tmp_path / 'o')])
    x = r['runs'][0]
    assert (x['prompts'], x['same_output'], r['copy_ngram']) == (2, 2, 4), x
    assert 0 < x['copied'] < x['steps'], x
    rows = list(csv.DictReader((tmp_path / 'o' / 'prompts.csv').read_text().splitlines()))
    assert sum(int(row['copied']) for row in rows) == x['copied']


def test_mt_bench_second_turn_by_category(tmp_path, capsys):
    """MT-Bench's questions (`turns` and `category`): --turn 2 asks the second question after the target's own greedy
    answer to the first, and the report, acceptance.json and prompts.csv give each category apart; a question with no
    second turn is passed over."""
    qs = [{'question_id': 81, 'category': 'writing', 'turns': ['the red cat', 'and the dog']},
          {'question_id': 91, 'category': 'math', 'turns': ['the blue house', 'and the river']},
          {'question_id': 92, 'category': 'math', 'turns': ['a tree']},
          {'question_id': 101, 'category': 'writing', 'turns': ['the green bird', 'why']}]
    data, out = tmp_path / 'question.jsonl', tmp_path / 'out'
    data.write_text(''.join(json.dumps(q) + '\n' for q in qs))
    r = speculate_main(['--target', str(toy_target_dir()), '--drafter', str(assets_dir() / 'toy-drafter'),
                        '--data', str(data), '--turn', '2', '--max-new-tokens', '12', '--temperature', '0',
                        '--threads', '1', '--no-progress', '--out', str(out)])
    said = capsys.readouterr().out
    run = r['runs'][0]
    assert (r['turn'], r['prompts'], run['same_output']) == (2, 3, 3), r
    assert {c: x['prompts'] for c, x in run['categories'].items()} == {'writing': 2, 'math': 1}, run['categories']
    assert sum(x['tokens'] for x in run['categories'].values()) == run['tokens']
    assert json.loads((out / 'acceptance.json').read_text())['runs'][0]['categories'].keys() == {'writing', 'math'}
    assert [x['category'] for x in read_rows(out)] == ['writing', 'math', 'writing']
    assert "user turn 2: an answer a record lacks before it is the target's own, greedy" in said, said
    assert 'category' in said and '\n  writing ' in said and '\n  math ' in said, said
