"""Resumes that cannot go wrong silently, and no silently wrong result: the data a run started with (found from any
directory, checked by its checksum), metrics never logged twice, a finished run's drafter restored and its training
extended, a metrics file torn by a crash, a start-up failure that leaves nothing behind; a cache cut to the run's
--max-length, a run with no finite step; a read-only run directory or speculate --out named in one line. Most cases
run the command's `main` in-process on copies of one small real run on the toy target; those that need permission
bits to hold run it as a subprocess."""
import csv, json, shutil
from pathlib import Path
import pytest, torch
from safetensors.torch import load_file, save_file
from dflash.core.files import toy_target_dir, toy_data_dir
from dflash.train.command import main as train_main
import conftest
from conftest import refused, tree, train_cli

SMALL = conftest.SMALL + ['--report-to', 'none']          # no tracker directory in the runs compared
RUN = SMALL + ['--max-steps', '4', '--save-every', '2', '--keep-checkpoints', '3', '--eval-every', '0']


def losses(run) -> dict[int, float]:
    return {int(r['step']): float(r['loss']) for r in csv.DictReader((Path(run) / 'metrics.csv').read_text().splitlines())}


def same_weights(a, b) -> bool:
    a, b = load_file(a), load_file(b)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope='module')
def finished(tmp_path_factory):
    "A finished 4-step run with its own copy of 16 conversations (which a test may rewrite and must put back)."
    home = tmp_path_factory.mktemp('home')
    lines = (toy_data_dir() / 'train.jsonl').read_text().splitlines()
    (home / 'train.jsonl').write_text('\n'.join(lines[:16]) + '\n')
    train_main(['--out', str(home / 'run'), '--data', str(home / 'train.jsonl'), *RUN])
    assert json.loads((home / 'run' / 'run.json').read_text())['status'] == 'finished'
    return home / 'run'


def _copy(run: Path, dest: Path, unfinished: bool = True) -> Path:
    "A copy of the run; `unfinished`: as if killed after its step-2 checkpoint (steps 3 and 4 logged)."
    shutil.copytree(run, dest)
    if unfinished:
        for p in ('drafter', 'checkpoints/step-0000004'): shutil.rmtree(dest / p)
        (dest / 'summary.json').unlink()
        rec = json.loads((dest / 'run.json').read_text())
        (dest / 'run.json').write_text(json.dumps({**rec, 'status': 'running'}))
    return dest


def test_relative_data_is_found_from_another_directory(tmp_path, monkeypatch, finished):
    """A run started with `--data train.jsonl` records the file's absolute path: killed and resumed from a directory
    with another `train.jsonl`, it reads its own and ends like the run that read it by its absolute path."""
    home, elsewhere = tmp_path / 'home', tmp_path / 'elsewhere'
    for d, source in ((home, 'train.jsonl'), (elsewhere, 'eval.jsonl')):
        d.mkdir()
        (d / 'train.jsonl').write_text('\n'.join((toy_data_dir() / source).read_text().splitlines()[:16]) + '\n')
    monkeypatch.chdir(home)
    train_main(['--out', str(tmp_path / 'run'), '--data', 'train.jsonl', *RUN])
    rec = json.loads((tmp_path / 'run' / 'run.json').read_text())
    assert rec['config']['data'] == str(home / 'train.jsonl'), rec['config']['data']
    run = _copy(tmp_path / 'run', tmp_path / 'killed')
    monkeypatch.chdir(elsewhere)
    train_main(['--out', str(run), '--resume'])
    assert losses(run) == losses(finished)
    assert same_weights(run / 'drafter' / 'model.safetensors', finished / 'drafter' / 'model.safetensors')
    timed = lambda r: json.loads((r / 'summary.json').read_text())['timed_steps']
    assert timed(run) == [2, 4] and timed(finished) == [0, 4]     # which steps the summary's seconds are of


def test_data_changed_in_place_is_refused_unless_accepted(tmp_path, capsys, finished):
    run = _copy(finished, tmp_path / 'run')
    data = finished.parent / 'train.jsonl'
    kept = data.read_text()
    before = tree(run)
    try:
        data.write_text(kept.replace('"content": "', '"content": "Well, ', 1))    # one turn of one conversation
        refused(capsys, train_main, ['--out', str(run), '--resume'], f"--data: {data} changed since the run started (SHA-256",
                "pass --accept-changed-data to go on with the data as it is now")
        assert tree(run) == before, "nothing of the run is touched"
        train_main(['--out', str(run), '--resume', '--accept-changed-data'])
        assert 'data changed on resume (--accept-changed-data): --data:' in capsys.readouterr().out
    finally: data.write_text(kept)
    rec = json.loads((run / 'run.json').read_text())
    assert rec['status'] == 'finished' and 'accept_changed_data' not in rec['config']
    assert rec['resumes'][-1]['data_changed'][0].startswith(f"--data: {data} changed since the run started")
    assert rec['data']['data']['sha256'] != json.loads((finished / 'run.json').read_text())['data']['data']['sha256']


def test_metrics_without_a_checkpoint_are_refused(tmp_path, capsys, finished):
    "Checkpoints deleted, metrics kept: a resume would train steps 1-4 again under the logged ones; it is refused."
    run = _copy(finished, tmp_path / 'run')
    shutil.rmtree(run / 'checkpoints')
    before = tree(run)
    refused(capsys, train_main, ['--out', str(run), '--resume'], 'metrics.csv logs steps 1..4 but no checkpoint is left',
            '--overwrite')
    assert tree(run) == before and not (run / '.lock').exists()


def test_finished_run_gets_its_drafter_back(tmp_path, capsys, finished):
    run = _copy(finished, tmp_path / 'run', unfinished=False)
    shutil.rmtree(run / 'drafter')
    train_main(['--out', str(run), '--resume'])
    assert 'finished at step 4 but its drafter is missing: exporting it again' in capsys.readouterr().out
    assert same_weights(run / 'drafter' / 'model.safetensors', finished / 'drafter' / 'model.safetensors')
    assert losses(run) == losses(finished) and json.loads((run / 'run.json').read_text())['status'] == 'finished'


def test_finished_run_is_extended_by_more_steps(tmp_path, capsys, finished):
    run = _copy(finished, tmp_path / 'run', unfinished=False)
    train_main(['--out', str(run), '--resume', '--max-steps', '4'])
    assert 'leaves it as it is' in capsys.readouterr().out, "the same steps: nothing to do"
    assert tree(run) == tree(finished)
    train_main(['--out', str(run), '--resume', '--max-steps', '6'])
    assert 'finished at step 4; continuing it to step 6' in capsys.readouterr().out
    got = losses(run)
    assert sorted(got) == list(range(1, 7)) and {k: got[k] for k in range(1, 5)} == losses(finished)
    rec = json.loads((run / 'run.json').read_text())
    assert (rec['status'], rec['step'], rec['resumes'][-1]['changed']) == ('finished', 6, {'max_steps': [4, 6]})
    assert (run / 'checkpoints' / 'step-0000006').is_dir()
    assert not same_weights(run / 'drafter' / 'model.safetensors', finished / 'drafter' / 'model.safetensors')


@pytest.mark.parametrize('tail', [b'1', b'\x00' * 300, b'5,\x00\x00\n'], ids=['cut-in-step', 'nul-bytes', 'nul-row'])
def test_torn_last_metrics_line_is_dropped(tmp_path, capsys, finished, tail):
    """A crash mid-append leaves a torn last line in metrics.csv (a row like `12,…` cut after its first digit, or NUL
    bytes where the file system extended it); the resume drops it, says so, and ends like the uninterrupted run."""
    run = _copy(finished, tmp_path / 'run')
    with open(run / 'metrics.csv', 'ab') as f: f.write(tail)
    train_main(['--out', str(run), '--resume'])
    assert 'metrics.csv: its last line was cut off mid-write' in capsys.readouterr().out
    assert losses(run) == losses(finished)


def test_failed_start_leaves_nothing_to_refuse(tmp_path, capsys, finished):
    "A target whose tokenizer has no chat template fails at start-up; the corrected command then starts in `out`."
    target = tmp_path / 'target'
    shutil.copytree(toy_target_dir(), target)
    (target / 'chat_template.jinja').unlink()
    run, data = tmp_path / 'run', str(finished.parent / 'train.jsonl')
    argv = ['--out', str(run), '--target', str(target), '--data', data, *SMALL, '--max-steps', '1']
    refused(capsys, train_main, argv, 'its tokenizer has no chat template')
    assert not [p.name for p in run.iterdir()], "nothing left in the run directory"
    train_main(['--out', str(run), '--target', str(toy_target_dir()), '--data', data, *SMALL, '--max-steps', '1'])
    assert json.loads((run / 'run.json').read_text())['status'] == 'finished'


def test_run_with_no_finite_step_fails_and_exports_nothing(tmp_path, capsys, finished):
    "A target with an infinite weight gives non-finite features at every step: the run fails, nothing is exported."
    target = tmp_path / 'target'
    shutil.copytree(toy_target_dir(), target)
    w = load_file(target / 'model.safetensors')
    name = next(k for k in w if k.endswith('layers.0.mlp.down_proj.weight'))
    w[name][0, 0] = float('inf')
    save_file(w, target / 'model.safetensors', metadata={'format': 'pt'})
    run = tmp_path / 'run'
    refused(capsys, train_main, ['--out', str(run), '--target', str(target), '--data', str(finished.parent / 'train.jsonl'), *SMALL,
                     '--max-steps', '2', '--save-every', '1'],
            'none of the 2 steps had a finite loss and gradient norm', 'nothing is checkpointed or exported', code=1)
    assert not (run / 'drafter').exists() and not (run / 'checkpoints').exists() and not (run / '.lock').exists()


def test_cache_samples_are_cut_to_max_length(tmp_path, capsys, finished):
    "A cache written with --max-length 512 read by a run planned for 64 tokens: the run's samples are cut to 64."
    from dflash.data.command import main as data_main
    from dflash.core.schema import TrainConfig
    from dflash.train.trainer import Trainer
    data_main(['cache', '--target', str(toy_target_dir()), '--data', str(finished.parent / 'train.jsonl'), '--out',
               str(tmp_path / 'cache'), '--max-length', '512', '--num-draft-layers', '2', '--no-progress'])
    cached = json.loads((tmp_path / 'cache' / 'manifest.json').read_text())
    assert cached['num_tokens'] > 64 * cached['num_samples'], "the cache holds samples longer than 64 tokens"
    capsys.readouterr()
    t = Trainer(TrainConfig(cache=str(tmp_path / 'cache'), out=str(tmp_path / 'run'), num_layers=2, num_anchors=16,
                            max_length=64, batch_size=4, attention='eager', report_to='none'))
    assert f"written with max_length 512; its samples are cut to --max-length 64" in capsys.readouterr().out
    assert max(len(t.parts.train[i]['input_ids']) for i in range(len(t.parts.train))) == 64
    assert t.parts.train[0]['context'].shape[0] == 64


def test_read_only_directory_at_start_is_named(tmp_path, finished):
    ro = tmp_path / 'ro'
    ro.mkdir()
    ro.chmod(0o555)
    r = train_cli('--out', ro / 'run', '--data', finished.parent / 'train.jsonl', *RUN)
    assert r.returncode == 2 and 'Traceback' not in r.stderr, r.stderr[-3000:]
    assert f"error: {ro / 'run'}: Permission denied (EACCES): make room or make it writable" in r.stderr, r.stderr
    assert not list(ro.iterdir())


def test_read_only_checkpoints_are_named_and_leave_nothing_partial(tmp_path, finished):
    "The checkpoint of step 4 cannot be written: the run ends in one line naming it; once writable, it resumes."
    run = _copy(finished, tmp_path / 'run')
    (run / 'checkpoints').chmod(0o555)
    r = train_cli('--out', run, '--resume')
    assert r.returncode == 2 and 'Traceback' not in r.stderr, r.stderr[-3000:]
    step4 = run / 'checkpoints' / 'step-0000004'                   # named by the checkpoint it could not write
    assert f"error: {step4}: Permission denied (EACCES)" in r.stderr, r.stderr
    assert [p.name for p in (run / 'checkpoints').iterdir()] == ['step-0000002'] and not (run / '.lock').exists()
    (run / 'checkpoints').chmod(0o755)
    assert train_cli('--out', run, '--resume').returncode == 0
    assert losses(run) == losses(finished)


def test_speculate_checks_its_out_before_it_evaluates(tmp_path):
    "A read-only --out is refused with the options, before the models load, not after minutes of decoding."
    from dflash.core.files import assets_dir
    ro = tmp_path / 'ro'
    ro.mkdir()
    ro.chmod(0o555)
    r = train_cli('--target', toy_target_dir(), '--drafter', assets_dir() / 'toy-drafter', '--data',
                  toy_data_dir() / 'eval.jsonl', '--num-prompts', '2', '--max-new-tokens', '8', '--out', ro / 'spec',
                  module='dflash.speculate')
    assert r.returncode == 2 and 'Traceback' not in r.stderr, r.stderr[-3000:]
    assert f"--out = '{ro / 'spec'}': cannot write there (Permission denied: {ro / 'spec'})" in r.stderr, r.stderr
    assert 'tau' not in r.stdout, "nothing was evaluated"
