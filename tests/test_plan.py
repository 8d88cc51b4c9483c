"`python -m dflash.plan` as a user runs it: a shipped target by name, and the README's table, which must be current."
import subprocess, sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / 'README.md'


def run_plan(*argv, cwd):
    return subprocess.run([sys.executable, '-m', 'dflash.plan', *argv], capture_output=True, text=True, cwd=cwd,
                          timeout=900)


def test_shipped_target_plans_without_a_file(tmp_path):
    r = run_plan('--target-config', 'qwen3-8b', '--seq-len', '8192', '--anchors', '512', '--memory', '80GiB',
                 cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert 'drafter: 5 layers, hidden 4096, 32/8 heads of 128, intermediate 12288, vocab 151936; S=8192' in r.stdout
    assert 'use --checkpointing none' in r.stdout and 'online mode adds the target' in r.stdout
    assert list(tmp_path.iterdir()) == []                                    # nothing read or written here


def test_unknown_name_is_refused_with_the_shipped_names(tmp_path):
    r = run_plan('--target-config', 'qwen3-9b', cwd=tmp_path)
    assert r.returncode == 2 and "model 'qwen3-9b': no such path" in r.stderr, r.stderr
    assert "; the shipped targets are gpt-oss-20b, llama-3.1-8b-instruct, qwen3-32b, qwen3-4b, qwen3-8b" in r.stderr
    assert 'gpt-oss-20b' in run_plan('--help', cwd=tmp_path).stdout


def test_readme_fits_table_is_current():
    """The README's rows at S = 3072, for every shipped target, are what the planner says now. (Its rows at S = 8192
    run the same code at another length and cost twice the time; `--fits-table` rewrites them all.)"""
    from dflash.model.planner import fits_table
    text = README.read_text()
    start, end = '<!-- fits-table: written by python -m dflash.plan --fits-table README.md -->', '<!-- /fits-table -->'
    lines = text[text.index(start) + len(start):text.index(end)].strip().splitlines()
    shown = lines[:2] + [line for line in lines[2:] if line.split('|')[2].strip() == '3072']
    assert len(shown) == 2 + 2 * 5, shown                        # header, rule, offline and online for each target
    assert fits_table(seq_lens=(3072,)).splitlines() == shown, \
        "README.md's fits table is out of date: run python -m dflash.plan --fits-table README.md"


def test_fits_table_needs_its_markers(tmp_path):
    (tmp_path / 'notes.md').write_text('# notes\n')
    r = run_plan('--fits-table', 'notes.md', cwd=tmp_path)
    assert r.returncode == 2 and '--fits-table notes.md: no fits-table markers' in r.stderr, r.stderr
