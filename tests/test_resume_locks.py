"""Nothing lost, nothing silently wrong, in three places. A resume that changes the run's step count says so in one
line (the step it resumes at, the learning rate there under the new count, where the decay moves), and one asked for
fewer steps than the run has taken is refused. An output that another process is still writing (its writer's lock
held: a corpus `data regenerate` writes, a cache `data cache` writes, the drafter of a run still training) is refused
by every command that would read it, and read once the writer is done. `python -m dflash.bench quality` refuses to
replace earlier results unless `--overwrite`. Resumes run `dflash.train`'s `main` in-process on copies of one small
real run on the toy target (`test_resume`'s); a writer is a separate process holding the lock with the project's
own `take_lock`, as the writing commands do."""
import csv, json, shutil, subprocess, sys
from contextlib import contextmanager
from pathlib import Path
import pytest
from dflash.core.files import assets_dir, toy_data_dir, toy_target_dir
from dflash.train.command import main as train_main, parse_config
from dflash.data.command import main as data_main
from dflash.decoding.speculate import main as speculate_main
from dflash.bench.command import COMMANDS as BENCHES, main as bench_main
from dflash.core.options import parse_subcommand
from conftest import refused, tree
from test_resume import RUN, _copy, losses

TOY = str(toy_target_dir())
QUICK = ['--max-steps', '1', '--eval-samples', '2', '--eval-every', '0', '--spec-eval-prompts', '0', '--report-to',
         'none', '--progress-bar', 'false', '--num-layers', '1', '--max-length', '64', '--batch-size', '2']


@pytest.fixture(scope='module')
def finished(tmp_path_factory):
    "`test_resume`'s finished 4-step run (WSD), evaluated on 2 held-out samples: a copy is resumed in seconds."
    home = tmp_path_factory.mktemp('home')
    (home / 'train.jsonl').write_text('\n'.join((toy_data_dir() / 'train.jsonl').read_text().splitlines()[:16]) + '\n')
    train_main(['--out', str(home / 'run'), '--data', str(home / 'train.jsonl'), *RUN, '--eval-samples', '2'])
    return home / 'run'


def metrics_lr(run, step: int) -> float:
    "The learning rate metrics.csv logs for `step` (the rate that step was taken at)."
    return next(float(r['lr']) for r in csv.DictReader((Path(run) / 'metrics.csv').read_text().splitlines())
                if int(r['step']) == step)


# --- a resume that changes the step count ----------------------------------------------------------------------------
def test_extended_wsd_run_says_its_rate_goes_back_up(tmp_path, capsys, finished):
    "The finished 4-step WSD run ended its decay at rate 0; extended to 6 steps it resumes at the peak, and says so."
    run = _copy(finished, tmp_path / 'run', unfinished=False)
    train_main(['--out', str(run), '--resume', '--max-steps', '6'])
    assert ("resume: the run's step count changes from 4 to 6: it resumes at step 4 at learning rate 0.003 (the WSD "
            "decay moves from steps 4..4 to 6..6: the rate goes back up from 0 to 0.003)") in capsys.readouterr().out
    assert metrics_lr(run, 5) == 0.003, "the rate it said is the one step 5 was taken at"
    assert json.loads((run / 'run.json').read_text())['total_steps'] == 6


def test_shortened_run_says_where_it_resumes(tmp_path, capsys, finished):
    "Killed after its step-2 checkpoint and resumed with 3 steps in all: the line says so, the run ends at step 3."
    run = _copy(finished, tmp_path / 'run')
    train_main(['--out', str(run), '--resume', '--max-steps', '3'])
    assert ("resume: the run's step count changes from 4 to 3: it resumes at step 2 at learning rate 0.003 (the WSD "
            "decay moves from steps 4..4 to 3..3: the rate stays 0.003)") in capsys.readouterr().out
    assert sorted(losses(run)) == [1, 2, 3]
    assert json.loads((run / 'run.json').read_text())['step'] == 3


def test_run_shortened_to_its_checkpoint_says_nothing_is_left_to_train(tmp_path, capsys, finished):
    "--max-steps at the checkpoint's step: no step to take; said, and the run ends there with its drafter exported."
    run = _copy(finished, tmp_path / 'run')
    train_main(['--out', str(run), '--resume', '--max-steps', '2'])
    assert ("resume: the run's step count changes from 4 to 2: it ends at step 2, its checkpoint's, with no step left "
            "to train") in capsys.readouterr().out
    rec = json.loads((run / 'run.json').read_text())
    assert (rec['status'], rec['step']) == ('finished', 2) and (run / 'drafter' / 'model.safetensors').is_file()


def test_fewer_steps_than_the_checkpoint_are_refused(tmp_path, capsys, finished):
    "A run checkpointed at step 2 cannot end at step 1: refused, and nothing of the run changes (no metrics cut)."
    run = _copy(finished, tmp_path / 'run')
    before = tree(run)
    refused(capsys, train_main, ['--out', str(run), '--resume', '--max-steps', '1'],
            "error: --max-steps = 1: the run already has 2 steps (checkpoint", "a resume cannot take steps back",
            "pass --max-steps 2 or more")
    assert tree(run) == before and not (run / '.lock').exists()


def test_fewer_steps_than_a_finished_run_are_refused(tmp_path, capsys, finished):
    run = _copy(finished, tmp_path / 'run', unfinished=False)
    before = tree(run)
    refused(capsys, train_main, ['--out', str(run), '--resume', '--max-steps', '2'],
            "error: --max-steps = 2: the run already has 4 steps (it finished at step 4)",
            "pass --max-steps above 4 to train longer")
    assert tree(run) == before


# --- an output another process is still writing ----------------------------------------------------------------------
HOLD = ("import sys; from dflash.core.locks import take_lock, release_lock; take_lock(sys.argv[1], sys.argv[2]); "
        "print('held', flush=True); sys.stdin.read(); release_lock(sys.argv[1])")


@contextmanager
def writer(lock: Path, what):
    "Another process holding `lock` with the project's `take_lock`, as a command writing `what` does, until the end."
    p = subprocess.Popen([sys.executable, '-c', HOLD, str(lock), str(what)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == 'held'
        yield p.pid
    finally:
        p.stdin.close()                                            # the writer finishes and releases its lock
        p.wait(timeout=30)


def corpus(path: Path, n: int = 8) -> Path:
    "The first `n` toy conversations: what a `data regenerate` writing `path` has written so far."
    path.write_text('\n'.join((toy_data_dir() / 'train.jsonl').read_text().splitlines()[:n]) + '\n')
    return path


def busy(path, pid, lock, option='--data') -> str:
    return f"{option}: {path} is still being written by process {pid} (its lock {lock} is held): wait for it to finish"


def test_every_reader_refuses_a_corpus_still_being_written(tmp_path, capsys):
    "`data regenerate` writing `OUT` holds `OUT.lock`: each command that reads it as --data is refused meanwhile."
    data = corpus(tmp_path / 'regenerated.jsonl')
    lock = Path(f'{data}.lock')
    reads = [(data_main, ['tokenize', '--target', TOY, '--data', data]),
             (data_main, ['cache', '--target', TOY, '--data', data, '--out', tmp_path / 'cache']),
             (data_main, ['regenerate', '--target', TOY, '--data', data, '--out', tmp_path / 'again.jsonl']),
             (speculate_main, ['--target', TOY, '--drafter', assets_dir() / 'toy-drafter', '--data', data]),
             (train_main, ['--out', tmp_path / 'run', '--data', data, *QUICK])]
    with writer(lock, f'--out {data}') as pid:
        for main, argv in reads: refused(capsys, main, list(map(str, argv)), busy(data, pid, lock))
        refused(capsys, train_main, list(map(str, ['--out', tmp_path / 'run', '--data', toy_data_dir() / 'train.jsonl',
                                                   '--eval-data', data, *QUICK])),
                busy(data, pid, lock, '--eval-data'))
    assert sorted(p.name for p in tmp_path.iterdir()) == ['regenerated.jsonl'], "nothing written meanwhile"


def test_cache_reads_the_corpus_once_its_writer_is_done(tmp_path, capsys):
    "Refused while the writer holds its lock, `data cache` over the same corpus runs once it has released it."
    data = corpus(tmp_path / 'regenerated.jsonl')
    argv = list(map(str, ['cache', '--target', TOY, '--data', data, '--out', tmp_path / 'cache', '--no-progress']))
    with writer(Path(f'{data}.lock'), f'--out {data}') as pid:
        refused(capsys, data_main, argv, busy(data, pid, f'{data}.lock'))
    data_main(argv)
    assert json.loads((tmp_path / 'cache' / 'manifest.json').read_text())['complete']


def test_cache_being_written_is_neither_trained_on_nor_written_twice(tmp_path, capsys):
    """`data cache` holds `OUT.lock` while it writes (here: a rerun over a whole cache): `dflash.train --cache` and a
    second `data cache` to the same --out are refused meanwhile, and the cache is trained on once it is done."""
    cache, lock = tmp_path / 'cache', Path(f"{tmp_path / 'cache'}.lock")
    argv = list(map(str, ['cache', '--target', TOY, '--data', corpus(tmp_path / 'train.jsonl'), '--out', cache,
                          '--no-progress']))
    data_main(argv)
    assert not lock.exists(), "released when it is done"
    train = list(map(str, ['--out', tmp_path / 'run', '--target', TOY, '--cache', cache, *QUICK]))
    with writer(lock, f'--out {cache}') as pid:
        refused(capsys, train_main, train, busy(cache, pid, lock, '--cache'))
        refused(capsys, data_main, argv, f"--out {cache} is in use by process {pid}")
    assert parse_config(train).cache == [str(cache)]


def test_drafter_of_a_run_still_training_is_refused(tmp_path, capsys, finished):
    "A run being extended holds `RUN/.lock` and will replace `RUN/drafter`: speculate waits for it to finish."
    run = _copy(finished, tmp_path / 'run', unfinished=False)
    argv = list(map(str, ['--target', TOY, '--drafter', run / 'drafter', '--data', toy_data_dir() / 'eval.jsonl',
                          '--num-prompts', '1', '--max-new-tokens', '4', '--temperature', '0', '--lookup-tokens', '0',
                          '--no-progress']))
    with writer(run / '.lock', run) as pid:
        refused(capsys, speculate_main, argv, busy(run / 'drafter', pid, run / '.lock', '--drafter'))
    assert speculate_main(argv)


# --- the quality bench's earlier results -----------------------------------------------------------------------------
def test_quality_bench_refuses_to_replace_earlier_results(tmp_path, capsys):
    "Refused before anything runs; --overwrite (which moves them aside, as train's does) passes the option checks."
    out = tmp_path / 'quality'
    (out / 'runs' / 'ce-s0').mkdir(parents=True)
    (out / 'quality.csv').write_text('objective,seed\nce,0\n')
    before = tree(out)
    argv = ['quality', '--objectives', 'ce', '--seeds', '0', '--max-steps', '1', '--prompts', '1', '--new-tokens', '4',
            '--temperatures', '0', '--threads', '1', '--out', str(out)]
    refused(capsys, bench_main, argv, f"--out = {str(out)!r}: holds the results of an earlier quality run (quality.csv, "
                                      f"runs); pass --overwrite to move them aside")
    assert tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ['quality']
    name, opts = parse_subcommand(BENCHES, [*argv, '--overwrite'])
    assert (name, opts.overwrite) == ('quality', True)
    shutil.rmtree(out)
    assert parse_subcommand(BENCHES, argv)[1].out == str(out), "an --out without results: no --overwrite needed"


def test_quality_bench_refuses_a_file_for_out(tmp_path, capsys):
    "An --out that is a file: a named error before anything trains, and the file as it was."
    out = tmp_path / 'quality.txt'
    out.write_text('notes\n')
    argv = ['quality', '--objectives', 'ce', '--seeds', '0', '--max-steps', '1', '--prompts', '1', '--new-tokens', '4',
            '--temperatures', '0', '--threads', '1', '--out', str(out)]
    refused(capsys, bench_main, argv, f"--out = {str(out)!r}: cannot write there (Not a directory")
    assert out.read_text() == 'notes\n' and sorted(p.name for p in tmp_path.iterdir()) == ['quality.txt']
