"""`python -m dflash.bench real`: the whole path (synthesize, cache, train, measure, each lever) in real processes.
On the toy target, whose speed is the point here; its figures mean nothing, its files and their agreement do."""
import csv, json, os, subprocess, sys
import torch
from conftest import train_cli
from dflash.model.drafter import DFlashDrafter
from dflash.core.files import toy_data_dir, toy_target_dir

ENV = {**os.environ, 'OMP_NUM_THREADS': '1', 'TOKENIZERS_PARALLELISM': 'false'}


def test_the_whole_path_writes_its_report_and_a_bf16_drafter_that_decodes_losslessly(tmp_path):
    from safetensors import safe_open
    work, out = tmp_path / 'work', tmp_path / 'out'
    cmd = [sys.executable, '-m', 'dflash.bench', 'real', '--target', toy_target_dir(),
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
    assert '| T | prompts | τ |' in (out / 'real.md').read_text() and (out / 'real.png').stat().st_size > 0
    with safe_open(str(out / 'drafter' / 'model.safetensors'), 'pt') as f:
        dtypes = {str(f.get_tensor(k).dtype) for k in f.keys() if f.get_tensor(k).is_floating_point()}
    assert dtypes == {'torch.bfloat16'}
    assert json.loads((out / 'drafter' / 'config.json').read_text())['draft_vocab_size'] == 256
    again = [*cmd[:cmd.index('--minutes')], '--temperatures', '0', '--run', work / 'runs' / 'base', '--work', work,
             '--out', tmp_path / 'again']                  # the same drafter measured from its run: nothing trained
    r = subprocess.run(list(map(str, again)), env=ENV, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert 'synthesizing' not in r.stdout and (work / 'data.jsonl').read_text().splitlines() == data
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
                            csv.DictReader((tmp_path / 'w' / 'eval' / lever / f'part-{i}' / 'prompts.csv').open())]
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
