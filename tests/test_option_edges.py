"""Options that would be silently wrong or end in a traceback: an option the chosen loss or schedule does not read, a
flag given twice, a temperature that overflows, a seed no generator takes. Each is one named error (exit 2) before
any model loads, and nothing is written; and one dtype vocabulary, both spellings taken by every `--dtype`. The commands' `main` runs
in-process."""
from pathlib import Path
import pytest
from dflash.core.files import assets_dir, toy_data_dir, toy_target_dir
from dflash.data.command import main as data_main
from dflash.data.regenerate import main as regenerate_main
from dflash.decoding.speculate import main as speculate_main
from dflash.train.command import main as train_main, parse_config
from dflash.core.options import OptionParser, parse_options
from dflash.core.schema import DTYPES, CacheOptions, PlanOptions, RegenConfig, SpeculateOptions, SynthConfig
from dflash.core.bench_schema import AttentionBench, ScalingBench, StepBench
from conftest import refused

# were one of these accepted, the run it starts is short: a step, no evaluation, no tracker
QUICK = ['--max-steps', '1', '--eval-samples', '2', '--eval-every', '0', '--spec-eval-prompts', '0', '--report-to',
         'none', '--num-layers', '1', '--max-length', '128', '--batch-size', '2', '--progress-bar', 'false']
TRAIN, EVAL = str(toy_data_dir() / 'train.jsonl'), str(toy_data_dir() / 'eval.jsonl')


# --- 4. options are consistent ---------------------------------------------------------------------------------------
UNREAD = [
    (['--loss', 'ce', '--kl-weight', '0.5'], "--kl-weight = 0.5: read only with --loss kl or tv, and --loss is ce"),
    (['--loss', 'ce', '--kl-temperature', '2'], "--kl-temperature = 2.0: read only with --loss kl or tv, and --loss is ce"),
    (['--loss', 'ce', '--dpace-alpha', '0.3'],
     "--dpace-alpha = 0.3: read only with --loss dpace or dpace-confidence or dpace-continuation, and --loss is ce"),
    (['--loss', 'dpace', '--gamma', '5'], "--gamma = 5.0: read only with --loss ce or kl or tv, and --loss is dpace"),
    (['--schedule', 'cosine', '--decay-ratio', '0.1'],
     "--decay-ratio = 0.1: read only with --schedule wsd, and --schedule is cosine"),
]


@pytest.mark.parametrize('argv,expect', UNREAD, ids=[' '.join(a) for a, _ in UNREAD])
def test_an_option_the_run_does_not_read_is_refused(tmp_path, capsys, argv, expect):
    refused(capsys, train_main, ['--out', str(tmp_path / 'run'), *QUICK, *argv], expect, 'leave it out')
    assert not (tmp_path / 'run').exists()


def test_an_unread_option_in_yaml_is_refused_and_defaults_are_not(tmp_path, capsys):
    (tmp_path / 'run.yaml').write_text('loss: ce\nkl_weight: 0.5\n')
    refused(capsys, train_main, ['--out', str(tmp_path / 'run'), *QUICK, '--config', str(tmp_path / 'run.yaml')],
            "--kl-weight = 0.5: read only with --loss kl")
    c = parse_config(['--out', str(tmp_path / 'run'), '--loss', 'ce', '--schedule', 'cosine'])   # defaults: unread, fine
    assert (c.loss, c.kl_weight, c.decay_ratio) == ('ce', 1.0, 0.2)
    assert parse_config(['--loss', 'kl', '--kl-weight', '0.5', '--gamma', '3']).kl_weight == 0.5     # read: accepted


TWICE = [(['--data', TRAIN, '--data', EVAL], '--data'), (['--data', TRAIN, '--data=' + EVAL], '--data'),
         (['--eval-data', EVAL, '--eval_data', EVAL], '--eval-data')]


@pytest.mark.parametrize('argv,name', TWICE, ids=['twice', 'with =', 'both spellings'])
def test_a_flag_given_twice_is_an_error(tmp_path, capsys, argv, name):
    refused(capsys, train_main, ['--out', str(tmp_path / 'run'), *QUICK, *argv], f"{name} given 2 times", 'give it once')
    assert not (tmp_path / 'run').exists()


def test_a_flag_given_twice_is_an_error_for_every_command(tmp_path, capsys):
    chat = tmp_path / 'chat.jsonl'
    chat.write_text('\n'.join(Path(EVAL).read_text().splitlines()[:2]) + '\n')
    refused(capsys, data_main, ['cache', '--target', str(toy_target_dir()), '--data', str(chat), '--out',
                                str(tmp_path / 'a'), '--out', str(tmp_path / 'b'), '--layers', '1', '--no-progress'],
            "--out given 2 times")
    refused(capsys, speculate_main, ['--target', str(toy_target_dir()), '--drafter', str(assets_dir() / 'toy-drafter'),
                                     '--data', str(chat), '--num-prompts', '1', '--max-new-tokens', '4', '--temperature',
                                     '0', '--seed', '1', '--seed', '2', '--no-progress'], "--seed given 2 times")
    assert sorted(p.name for p in tmp_path.iterdir()) == ['chat.jsonl']


# --- 5. numeric edges: a temperature that overflows, a seed no generator takes -----------------------------------------
BIG = str(2**64)


def test_speculate_names_a_tiny_temperature_and_a_huge_seed(tmp_path, capsys):
    err = refused(capsys, speculate_main, ['--target', str(toy_target_dir()), '--drafter',
                                           str(assets_dir() / 'toy-drafter'), '--data', EVAL, '--num-prompts', '1',
                                           '--max-new-tokens', '8', '--temperature', '1e-300', '--seed', BIG,
                                           '--out', str(tmp_path / 'spec'), '--no-progress'],
                  "--temperature = [1e-300]: allowed 0 or >= 0.01", f"--seed = {BIG}: allowed >= 0 and <= 4294967295")
    assert '2 bad options' in err


def test_regenerate_names_a_tiny_temperature_and_a_huge_seed(tmp_path, capsys):
    refused(capsys, regenerate_main, ['--data', EVAL, '--out', str(tmp_path / 'out.jsonl'), '--temperature', '1e-300',
                                      '--seed', BIG, '--max-new-tokens', '8', '--batch-size', '4', '--no-progress'],
            "--temperature = 1e-300: allowed 0 or >= 0.01", f"--seed = {BIG}: allowed >= 0 and <= 4294967295")
    assert not (tmp_path / 'out.jsonl').exists()


def test_train_names_a_huge_seed(tmp_path, capsys):
    refused(capsys, train_main, ['--out', str(tmp_path / 'run'), *QUICK, '--seed', BIG],
            f"--seed = {BIG}: allowed >= 0 and <= 4294967295")
    assert not (tmp_path / 'run').exists()


# --- 6. one dtype vocabulary: torch's names and the short ones, alike --------------------------------------------------
WITH_DTYPE = [PlanOptions, SpeculateOptions, CacheOptions, RegenConfig, SynthConfig, AttentionBench, ScalingBench, StepBench]


@pytest.mark.parametrize('cls', WITH_DTYPE, ids=lambda c: c.__name__)
def test_every_dtype_option_takes_both_spellings(cls):
    "`--dtype bf16` and `--dtype bfloat16` are the same dtype for every command, and `--help` lists both."
    for short, name in (('fp32', 'float32'), ('bf16', 'bfloat16')):
        given = [parse_options(cls, ['--dtype', s])[0].dtype for s in (short, name)]
        assert [DTYPES[g] for g in given] == [name, name]
    assert 'bfloat16, bf16' in ' '.join(OptionParser(cls).format_help().split())


def test_a_regeneration_records_its_dtype_by_torchs_name(tmp_path):
    "An index written with `--dtype bf16` is continued by `--dtype bfloat16`: the header says `bfloat16` for both."
    from dflash.data.regenerate import run_header
    h = [run_header(RegenConfig(data=EVAL, out=str(tmp_path / 'o.jsonl'), dtype=d)) for d in ('bf16', 'bfloat16')]
    assert h[0] == h[1] and h[0]['options']['dtype'] == 'bfloat16'
