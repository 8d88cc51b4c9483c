"The house rules that keep the package easy to change, checked on the exported modules."
import ast, subprocess, sys, time
from pathlib import Path
import pytest

PKG = Path(__file__).resolve().parents[1] / 'dflash'
MODULES = sorted(p for p in PKG.glob('*.py') if p.name != '_modidx.py')


def test_no_module_imports_another_modules_private_names():
    found = []
    for p in MODULES:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or '').startswith('dflash')):
                found += [f"{p.name}: {node.module}.{a.name}" for a in node.names
                          if a.name.startswith('_') and not a.name.startswith('__')]
    assert not found, found


def test_model_modules_do_not_import_matplotlib():
    "Every rank imports the model and the trainer; plots import matplotlib only when they draw."
    code = ("import sys, dflash.drafter, dflash.attention, dflash.trainer, dflash.plan; "
            "print('matplotlib' in sys.modules)")
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=PKG.parent)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == 'False'


COMMANDS = ['train', 'data', 'plan', 'bench', 'speculate', 'toy', 'regenerate']


@pytest.mark.parametrize('command', COMMANDS)
def test_help_answers_in_under_3_seconds(command):
    "`python -m dflash.X --help` in a fresh process: under 3 s, with neither torch nor transformers' models loaded."
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, '-X', 'importtime', '-m', f'dflash.{command}', '--help'], capture_output=True,
                       text=True, cwd=PKG.parent, timeout=60)
    seconds = time.perf_counter() - t0
    assert r.returncode == 0 and r.stdout.startswith('usage:'), r.stderr[-2000:]
    loaded = {line.rsplit('|', 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith('import time:')}
    assert not {'torch', 'transformers.models', 'datasets', 'matplotlib'} & loaded, sorted(loaded)
    assert seconds < 3, f"python -m dflash.{command} --help took {seconds:.1f} s"
