"Every package the exported modules import is installed by the runtime requirements, so `pip install -e .` runs them."
import ast, configparser, re, sys
from importlib.metadata import PackageNotFoundError, packages_distributions, requires
from pathlib import Path

ROOT = Path(__file__).parents[1]
# imported only by an option that checks for the package first and says how to install it when it is missing
OPTIONAL = {'vllm',   # `python -m dflash.regenerate --engine vllm` (needs a GPU too)
            'gguf'}   # a `.gguf` target: `pip install 'dflash[gguf]'`, named by the options' check when missing

def _name(req: str) -> str: return re.split(r'[<>=!~;\[ ]', req.strip(), maxsplit=1)[0].lower().replace('_', '-')

def imported_packages() -> set[str]:
    "Top-level names the modules of `dflash/` import, without the standard library and the package itself."
    names = set()
    for f in (ROOT / 'dflash').rglob('*.py'):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import): names |= {a.name.split('.')[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0: names.add(node.module.split('.')[0])
    return names - set(sys.stdlib_module_names) - {'__future__', 'dflash'} - OPTIONAL

def runtime_distributions() -> set[str]:
    "Distributions that `requirements` in settings.ini installs, with their own requirements (extras aside)."
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / 'settings.ini')
    todo, seen = [_name(r) for r in cfg['DEFAULT']['requirements'].split()], set()
    while todo:
        d = todo.pop()
        if d in seen: continue
        seen.add(d)
        try: todo += [_name(r) for r in requires(d) or [] if 'extra ==' not in r]
        except PackageNotFoundError: pass                 # a platform-only dependency not installed here
    return seen

def test_runtime_requirements_cover_imports():
    dists = packages_distributions()
    missing = {n: dists.get(n) for n in imported_packages()
               if not {_name(d) for d in dists.get(n, [n])} & runtime_distributions()}
    assert not missing, f"imported by dflash/ but not installed by settings.ini requirements: {missing}"
