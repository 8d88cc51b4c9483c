"""One exit policy for every command, whichever way it was started: input a command cannot use is one named `error:`
line (exit 2), a bug shows its traceback and says it is one (exit 1), and `--debug` shows the traceback of a user error
too. The bugs are deliberate: a real command whose internals are made to fail, in a process of its own."""
import subprocess, sys
from dflash.core.files import toy_target_dir


def _run(code: str, *args) -> subprocess.CompletedProcess:
    "Python `code` in a fresh process (the package's own directory on the path) with `args` as its arguments."
    return subprocess.run([sys.executable, '-c', code, *args], capture_output=True, text=True, timeout=600)


def test_a_bug_inside_the_trainer_shows_its_traceback_not_an_error_line(tmp_path):
    "A ValueError raised inside `Trainer(cfg)` by dflash itself used to read as bad input: `error: ...`, exit 2."
    code = ("import sys, dflash.train.trainer, dflash.train.command\n"
            "def broken(self, cfg): raise ValueError('deliberate: a shape the code got wrong')\n"
            "dflash.train.trainer.Trainer.__init__ = broken\n"
            "dflash.train.command.main(sys.argv[1:])")
    r = _run(code, '--out', str(tmp_path / 'run'), '--max-steps', '1')
    assert r.returncode == 1, r.stderr
    assert 'Traceback (most recent call last)' in r.stderr and 'in broken' in r.stderr, r.stderr
    assert r.stderr.rstrip().splitlines()[-1].startswith('error: this is a bug in dflash, not a problem with what you '
                                                         'gave (ValueError)'), r.stderr


def test_a_bug_in_a_data_command_shows_its_traceback(tmp_path):
    "The data commands caught every ValueError as the user's; a bug in reading the data is dflash's."
    (tmp_path / 'chat.jsonl').write_text('{"messages": [{"role": "user", "content": "hi"}, '
                                         '{"role": "assistant", "content": "hello"}]}\n')
    code = ("import sys, dflash.data.chat, dflash.data.command\n"
            "def broken(*a, **k): raise ValueError('deliberate')\n"
            "dflash.data.chat.load_chat_data = broken\n"
            "dflash.data.command.main(sys.argv[1:])")
    r = _run(code, 'tokenize', '--target', str(toy_target_dir()), '--data', str(tmp_path / 'chat.jsonl'))
    assert r.returncode == 1 and 'Traceback' in r.stderr and 'this is a bug in dflash' in r.stderr, r.stderr


def test_bad_data_stays_one_line_and_debug_shows_its_traceback(tmp_path):
    "The same command on data it cannot use: one line naming the file and line; under `--debug`, the traceback first."
    (tmp_path / 'chat.jsonl').write_text('{"messages": [{"role": "user", "content": "hi"}, '
                                         '{"role": "assistant", "content": "hello"}]}\n{"text": 3}\n')
    argv = ['tokenize', '--target', str(toy_target_dir()), '--data', str(tmp_path / 'chat.jsonl')]
    plain = subprocess.run([sys.executable, '-m', 'dflash.data', *argv], capture_output=True, text=True, timeout=600)
    debug = subprocess.run([sys.executable, '-m', 'dflash.data', *argv, '--debug'], capture_output=True, text=True,
                           timeout=600)
    assert plain.returncode == debug.returncode == 2, (plain.stderr, debug.stderr)
    said = [line for line in plain.stderr.splitlines() if line.startswith('error: ')]   # after the progress bars
    assert len(said) == 1 and f"{tmp_path / 'chat.jsonl'}:2: no 'messages'" in said[0], plain.stderr
    assert 'Traceback' not in plain.stderr and plain.stderr.rstrip().endswith(said[0]), plain.stderr
    assert 'Traceback (most recent call last)' in debug.stderr, debug.stderr
    assert debug.stderr.rstrip().endswith(said[0]), debug.stderr


def test_debug_is_listed_in_every_commands_help():
    for argv in (['dflash.train'], ['dflash.data', 'cache'], ['dflash.plan'], ['dflash.speculate'],
                 ['dflash.toy', 'build'], ['dflash.regenerate'], ['dflash.bench', 'step']):
        r = subprocess.run([sys.executable, '-m', *argv, '--help'], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and '--debug' in r.stdout, (argv, r.stdout[-500:])

