"""`dflash.train`, killed with SIGKILL (as a power cut would) at one point of the run: `--kill-at export` right after
the drafter's files are written and before they are renamed into place; `--kill-at final_eval` right after the export,
before the final evaluation. Launched as a module, like `dflash.train` (`accelerate launch -m killed_train ...`)."""
import os, runpy, signal, sys
from dflash.model.drafter import DFlashDrafter
from dflash.train.trainer import Trainer

i = sys.argv.index('--kill-at')
point = sys.argv.pop(i + 1)
sys.argv.pop(i)
owner, name = {'export': (DFlashDrafter, 'save_pretrained'), 'final_eval': (Trainer, 'export')}[point]
real = getattr(owner, name)


def then_die(*args, **kwargs):
    real(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)


setattr(owner, name, then_die)
runpy.run_module('dflash.train', run_name='__main__', alter_sys=True)
