"The house rules that keep the package easy to change, checked on the exported modules."
import ast, re, subprocess, sys, time
from pathlib import Path
import pytest

PKG = Path(__file__).resolve().parents[1] / 'dflash'
MODULES = sorted(p for p in PKG.rglob('*.py') if p.name != '_modidx.py')
LAYERS = ('core', 'model', 'data', 'decoding', 'train', 'bench')   # bottom up; the dispatcher and entries on top


def _name(path: Path) -> str:
    "A module's dotted name inside the package: 'data.chat', 'train.__main__', 'cli'."
    return '.'.join(path.relative_to(PKG).with_suffix('').parts)


def _layer(name: str) -> int:
    "The floor of module `name`: its subpackage's place in `LAYERS`, the top for the modules directly in dflash/."
    first = name.split('.')[0]
    return LAYERS.index(first) if first in LAYERS and '.' in name else len(LAYERS)


def test_no_module_imports_another_modules_private_names():
    found = []
    for p in MODULES:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or '').startswith('dflash')):
                found += [f"{p.name}: {node.module}.{a.name}" for a in node.names
                          if a.name.startswith('_') and not a.name.startswith('__')]
    assert not found, found


def test_the_public_api_is_at_most_180_names():
    "Each module's `__all__` is its public API; helpers the commands share besides are exported internal (`#| exporti`)."
    names = [e.value for p in MODULES for n in ast.parse(p.read_text()).body
             if isinstance(n, ast.Assign) and any(getattr(t, 'id', '') == '__all__' for t in n.targets)
             for e in n.value.elts]
    assert len(names) <= 180, len(names)


def test_model_modules_do_not_import_matplotlib():
    "Every rank imports the model and the trainer; plots import matplotlib only when they draw."
    code = ("import sys, dflash.model.drafter, dflash.model.attention, dflash.train.trainer, dflash.model.planner; "
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


def _notebook_of(path: Path) -> str:
    "The notebook a module is exported from, e.g. '22_data_features' (from the header nbdev writes)."
    m = re.search(r"File to edit: (?:\.\./)+nbs/(\w+)\.ipynb", path.read_text()[:800])
    assert m, f"{path.name}: no notebook named in its header"
    return m.group(1)


def _dflash_imports(path: Path) -> list[tuple[str, int]]:
    "(module, line) of every import of a dflash module in `path`, at the top or inside a function, as dotted names."
    names = {_name(p) for p in MODULES}
    here = _name(path).split('.')[:-1]                                   # the package `path` is in
    def known(dotted: str) -> str:                                       # `from .data import chat`: the module itself
        return dotted if dotted in names or not dotted else known(dotted.rsplit('.', 1)[0] if '.' in dotted else '')
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ''
            if node.level: base = here[:len(here) - node.level + 1]
            elif mod == 'dflash' or mod.startswith('dflash.'): base, mod = [], mod[len('dflash.'):] if '.' in mod else ''
            else: continue
            stem = '.'.join(base + ([mod] if mod else []))
            found += [(known(f"{stem}.{a.name}" if stem else a.name), node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(known(a.name[len('dflash.'):]), node.lineno) for a in node.names if a.name.startswith('dflash.')]
    return [(m, line) for m, line in found if m]


def test_every_import_points_to_an_earlier_notebook():
    "The package is one stack in notebook order: a module imports only modules of notebooks before its own."
    order = {_name(p): _notebook_of(p) for p in MODULES if p.stem != '__init__'}
    upward = [f"{_name(p)} ({order[_name(p)]}) line {line} imports {m} ({order[m]})"
              for p in MODULES if _name(p) in order for m, line in _dflash_imports(p)
              if m in order and order[m] >= order[_name(p)]]
    assert not upward, upward


def test_imports_run_only_down_the_layers():
    "core, model, data, decoding, train, bench: a module imports its own layer or the ones below, never above."
    upward = [f"{_name(p)} line {line} imports {m}" for p in MODULES for m, line in _dflash_imports(p)
              if _layer(m) > _layer(_name(p))]
    assert not upward, upward
    assert all(_layer(_name(p)) < len(LAYERS) for p in MODULES if p.parent != PKG)       # every subpackage is a layer


def test_only_thin_entries_lie_directly_in_the_package():
    "Beside the layers: the package's init, nbdev's index, the dispatcher, and command entries of at most 40 lines."
    loose = {p.name: len(p.read_text().splitlines()) for p in PKG.glob("*.py")}
    assert set(loose) - {'__init__.py', '_modidx.py', 'cli.py'} == {'plan.py', 'regenerate.py', 'speculate.py', 'toy.py'}
    long = {n: k for n, k in loose.items() if n != '_modidx.py' and k > 40}
    assert not long, long
    for pkg in ('data', 'train', 'bench'):                           # `python -m dflash.X` runs the package's __main__
        assert len((PKG / pkg / '__main__.py').read_text().splitlines()) <= 40


def test_the_import_graph_has_no_cycle():
    graph = {_name(p): {m for m, _ in _dflash_imports(p) if m != _name(p)} for p in MODULES}
    done, path = set(), []
    def visit(m):
        assert m not in path, f"import cycle: {' -> '.join(path[path.index(m):] + [m])}"
        if m in done or m not in graph: return
        path.append(m)
        for n in sorted(graph[m]): visit(n)
        path.pop()
        done.add(m)
    for m in sorted(graph): visit(m)


def test_dflash_lists_every_command():
    r = subprocess.run(['dflash', '--help'], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for command in COMMANDS: assert f"\n  {command} " in r.stdout, (command, r.stdout)


@pytest.mark.parametrize('command', COMMANDS)
def test_dflash_command_help_is_the_modules_help(command):
    "`dflash X --help` and `python -m dflash.X --help` print the same text, each under the name that was typed."
    commands = (['dflash', command, '--help'], [sys.executable, '-m', f'dflash.{command}', '--help'])
    console, module = (subprocess.run(c, capture_output=True, text=True, cwd=PKG.parent, timeout=60) for c in commands)
    assert console.returncode == module.returncode == 0, (console.stderr, module.stderr)
    assert console.stdout.startswith(f'usage: dflash {command} ') and 'python -m' not in console.stdout.split('\n')[0]
    typed = 'accelerate launch -m dflash.train' if command == 'train' else f'python -m dflash.{command}'
    words = lambda text: ' '.join(text.split())                      # argparse wraps the usage to the name's length
    assert words(console.stdout) == words(module.stdout.replace(typed, f'dflash {command}'))


def test_notebooks_import_only_earlier_notebooks():
    "A notebook reads top to bottom after the ones before it: no cell, exported or not, imports a later notebook."
    import json
    order = {_name(p): _notebook_of(p) for p in MODULES if p.stem != '__init__'}
    later = []
    for nb in sorted((PKG.parent / 'nbs').glob('[0-9]*.ipynb')):
        for cell in json.loads(nb.read_text())['cells']:
            code = ''.join(cell['source'])
            for m in re.finditer(r'(?:from dflash\.([\w.]+) import|import dflash\.([\w.]+))', code):
                mod = m.group(1) or m.group(2)
                if mod in order and order[mod] > nb.stem: later.append(f"{nb.stem} imports {mod} ({order[mod]})")
    assert not later, later


def _notebook_cells():
    "(notebook path, index, cell) of every cell of every notebook in nbs/."
    import json
    for nb in sorted((PKG.parent / 'nbs').glob('*.ipynb')):
        for i, cell in enumerate(json.loads(nb.read_text())['cells']): yield nb, i, cell


def test_notebook_outputs_name_no_machine_paths():
    "Committed outputs are read by everyone: no temporary directory, home or checkout of the machine that ran them."
    import json
    found = []
    for nb, i, cell in _notebook_cells():
        text = json.dumps(cell.get('outputs', []))
        for prefix in ('/tmp/', '/var/folders/', '/home/', '/root/', '/Users/', str(PKG.parent) + '/'):
            if prefix in text: found.append(f"{nb.name} cell {i}: {prefix}")
    assert not found, found


def _exception_classes(path: Path) -> list[str]:
    "The classes module `path` defines whose bases name an error or exception (an error class's own subclasses too)."
    tree = ast.parse(path.read_text())
    base = lambda b: b.id if isinstance(b, ast.Name) else getattr(b, 'attr', '')
    return [n.name for n in tree.body if isinstance(n, ast.ClassDef)
            and any(re.search(r'(Error|Exception|Failed|Preempted|NoFit|TooSmall)$', base(b)) for b in n.bases)]


def test_every_error_class_is_defined_in_core_errors():
    "One home for the errors: a reader finds every class a command can end with, and its exit status, in one module."
    elsewhere = {_name(p): names for p in MODULES if p.name != 'errors.py' and (names := _exception_classes(p))}
    assert not elsewhere, elsewhere
    assert len(_exception_classes(PKG / 'core' / 'errors.py')) >= 13


def test_one_main_process_test():
    "Whether this is the main process, read from the launcher's RANK, is written once: `main_process` in core.errors."
    found = [_name(p) for p in MODULES if "os.environ.get('RANK'" in p.read_text()]
    assert found == ['core.errors'], found


def _defaults_named(tree, name: str) -> list:
    "The default values given to parameters and fields called `name` (a field's `option(default, ...)` too)."
    found = []
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = n.args
            pos = a.posonlyargs + a.args
            found += [d for arg, d in zip(pos[len(pos) - len(a.defaults):], a.defaults) if arg.arg == name]
            found += [d for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None and arg.arg == name]
        if isinstance(n, ast.AnnAssign) and getattr(n.target, 'id', '') == name and n.value is not None:
            v = n.value
            found.append(v.args[0] if isinstance(v, ast.Call) and getattr(v.func, 'id', '') == 'option' and v.args else v)
    return found


def test_one_home_for_each_default():
    """The block size, the attention's chunk cost and the memory a plan assumes are written once, in core.names; every
    other default names them, and no GPU size is written in GB where GiB is meant."""
    literal = {}
    for p in MODULES:
        if _name(p) == 'core.names': continue
        tree = ast.parse(p.read_text())
        for field, bad in (('block_size', '16'), ('chunk_cost', '2 ** 19'), ('memory', "'80GiB'")):
            literal.update({f"{_name(p)}: {field} = {bad}": 1 for d in _defaults_named(tree, field)
                            if ast.unparse(d) == bad})
        for n in ast.walk(tree):
            text = ast.unparse(n) if isinstance(n, (ast.BinOp, ast.Constant)) else ''
            if text in ('2 ** 19', '80 * 2 ** 30') or re.fullmatch(r"'\d+GB'", text):
                literal[f"{_name(p)}: {text}"] = 1
    assert not literal, sorted(literal)


def test_readme_is_a_front_page():
    """The README is the front page: at most 250 lines, the manual in the notebooks and the diaries in benchmarks/,
    and every relative link in it (not inside a code block) names a file or directory that exists."""
    root = PKG.parent
    text = (root / 'README.md').read_text()
    assert len(text.splitlines()) <= 250, f"README.md has {len(text.splitlines())} lines: move details out of it"
    prose = re.sub(r'^```.*?^```', '', text, flags=re.S | re.M)
    links = [m for m in re.findall(r'\]\(([^)\s]+)\)', prose) if not m.startswith(('http://', 'https://', '#'))]
    assert links, 'no relative links found'
    missing = [link for link in links if not (root / link.split('#')[0]).exists()]
    assert not missing, missing


def test_index_notebook_is_reviewable():
    """nbs/index.ipynb, the README's notebook, holds it in cells a diff can review: no markdown cell over 3,000
    characters, and every section of the README starts in one of them."""
    import json
    root = PKG.parent
    cells = json.loads((root / 'nbs' / 'index.ipynb').read_text())['cells']
    long = [(i, len(''.join(c['source']))) for i, c in enumerate(cells)
            if c['cell_type'] == 'markdown' and len(''.join(c['source'])) > 3000]
    assert not long, f"markdown cells over 3,000 characters (index, length): {long}"
    headings = {line.strip() for c in cells if c['cell_type'] == 'markdown'
                for line in ''.join(c['source']).splitlines() if line.startswith('#')}
    sections = [line.strip() for line in (root / 'README.md').read_text().splitlines() if line.startswith('## ')]
    assert sections, 'README.md has no sections'
    missing = [s for s in sections if s not in headings]
    assert not missing, f"README.md sections missing from nbs/index.ipynb: {missing}"


def test_every_notebook_opens_clean():
    """Each notebook names its kernel (no "Select Kernel" dialog; opening and saving changes nothing in git) and commits
    no widget state: a widget's state is the live kernel's, and a stale copy shows models no output uses."""
    import json
    bad = []
    for nb in sorted((PKG.parent / 'nbs').glob('*.ipynb')):
        meta = json.loads(nb.read_text())['metadata']
        if meta.get('kernelspec', {}).get('name') != 'python3': bad.append(f"{nb.name}: no python3 kernelspec")
        if 'widgets' in meta: bad.append(f"{nb.name}: committed widget state")
    assert not bad, bad


def test_no_module_over_400_lines():
    "A module a newcomer reads in one sitting: split by job past 400 lines."
    long = {_name(p): n for p in MODULES if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


def test_no_export_cell_over_60_lines():
    "One concept per exported cell, followed by its example and test: no wall of code past 60 lines."
    long = []
    for nb, i, cell in _notebook_cells():
        src = ''.join(cell['source'])
        if cell['cell_type'] == 'code' and src.startswith(('#| export', '#| exporti')):
            if (n := len(src.splitlines())) > 60: long.append(f"{nb.name} cell {i}: {n} lines")
    assert not long, long
