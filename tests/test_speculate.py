"Speculative decoding with the trained toy drafter: lossless, and its tau agrees with the training-time estimate."
import json, subprocess, sys
import pytest, torch
from dflash.drafter import DFlashDrafter
from dflash.layout import BlockLayout
from dflash.objective import dflash_objective
from dflash.chat import ChatDataset
from dflash.features import TargetFeatures, collate
from dflash.speculate import eval_prompts, speculative_generate, greedy_generate, acceptance_eval
from dflash.toy import load_toy_target
from dflash.files import assets_dir, toy_data_dir, toy_target_dir


@pytest.fixture(scope='module')
def toy():
    torch.set_num_threads(1)
    target, tok = load_toy_target()
    drafter = DFlashDrafter.from_pretrained(assets_dir() / 'toy-drafter').eval()
    return target, tok, drafter


@pytest.mark.parametrize('block_size', [2, 4, 16])
def test_trained_drafter_is_lossless(toy, block_size):
    target, tok, drafter = toy
    prompts = eval_prompts(toy_data_dir() / 'eval.jsonl', tok, 6)
    accepted = []
    for p in prompts:
        spec = speculative_generate(target, drafter, p, max_new_tokens=48, block_size=block_size,
                                    stop_token_ids=[tok.eos_token_id])
        assert spec.tokens == greedy_generate(target, p, 48, [tok.eos_token_id])
        assert sum(spec.acceptance) == len(spec.tokens) - 1
        accepted += spec.acceptance
    assert max(accepted) > 1, "the trained drafter gets drafts accepted, so the multi-token path is exercised"


def test_sampling_is_reproducible(toy):
    "Speculative sampling with a seeded generator: the same seed gives the same tokens, another seed others."
    target, tok, drafter = toy
    p = eval_prompts(toy_data_dir() / 'eval.jsonl', tok, 1)[0]
    def run(seed):
        return speculative_generate(target, drafter, p, max_new_tokens=48, temperature=1., top_p=0.9,
                                    generator=torch.Generator().manual_seed(seed)).tokens
    assert run(0) == run(0) and run(0) != run(1)


def test_tau_agrees_with_training_time_estimate(toy):
    "The loop's tau and the objective's tau estimate on the same held-out conversations agree within 15%."
    target, tok, drafter = toy
    n = 48
    prompts = eval_prompts(toy_data_dir() / 'eval.jsonl', tok, n)
    spec = acceptance_eval(target, drafter, prompts, max_new_tokens=128, stop_token_ids=[tok.eos_token_id])
    feats = TargetFeatures(toy_target_dir(), layer_ids=drafter.config.target_layer_ids, device='cpu')
    data = ChatDataset.from_jsonl(toy_data_dir() / 'eval.jsonl', tok, max_length=512)
    total = None
    with torch.no_grad():
        for i in range(0, n, 8):
            b = collate([data[j] for j in range(i, min(i + 8, n))], pad_token_id=tok.pad_token_id)
            lay = BlockLayout.from_batch(b['input_ids'], b['loss_mask'], mask_token_id=drafter.config.mask_token_id,
                                         block_size=drafter.config.block_size, num_anchors=64,
                                         sample_ids=b['sample_ids'])
            s = dflash_objective(drafter(feats(b['input_ids'], b['attention_mask']), lay, feats.embed_weight),
                                 lay, feats.lm_head_weight)
            total = s if total is None else total + s
    est = total.tau.item()
    assert spec['tau'] > 2, spec
    assert abs(spec['tau'] - est) <= 0.15 * est, (spec['tau'], est)


def test_command_line(tmp_path):
    "`python -m dflash.speculate` as a real process on the toy target and drafter: it runs and writes its report."
    out = tmp_path / 'spec'
    run = subprocess.run([sys.executable, '-m', 'dflash.speculate', '--target', str(toy_target_dir()),
                          '--drafter', str(assets_dir() / 'toy-drafter'), '--data', str(toy_data_dir() / 'eval.jsonl'),
                          '--num-prompts', '3', '--max-new-tokens', '16', '--out', str(out)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    report = json.loads((out / 'acceptance.json').read_text())
    assert [r['temperature'] for r in report['runs']] == [0, 1], report          # greedy and T = 1 by default
    for r in report['runs']:
        assert r['tau'] >= 1 and sum(r['histogram']) == r['steps'] and r['speedup'] > 0, r
    assert (out / 'acceptance.png').is_file()
    bar = run.stderr.replace('\r', '\n')                   # the progress bar: prompts done, tokens/s, running tau
    for t in ('0', '1'):
        assert f'speculative T={t}: 100%' in bar and f'plain T={t}: 100%' in bar, run.stderr
    assert '3/3' in bar and 'tok/s, tau ' in bar, run.stderr


def test_histogram_keeps_its_labels():
    "The acceptance plot's x label lies inside the saved figure (it was cut off before)."
    from dflash.speculate import plot_acceptance
    ax = plot_acceptance([5, 3, 2, 1], title='tau = 1.82')
    fig = ax.figure
    fig.canvas.draw()
    box = ax.xaxis.label.get_window_extent()
    assert box.y0 >= 0 and box.x0 >= 0 and box.x1 <= fig.bbox.x1, (box, fig.bbox)


@pytest.mark.parametrize('module', ['dflash.speculate', 'dflash.plan'])
def test_help_answers_before_torch_loads(module):
    "`--help` prints every option with its default without importing torch or transformers' models."
    r = subprocess.run([sys.executable, '-X', 'importtime', '-m', module, '--help'], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.startswith(f'usage: python -m {module}'), r.stderr[-2000:]
    loaded = {line.rsplit('|', 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith('import time:')}
    assert not {'torch', 'transformers.models', 'matplotlib'} & loaded, sorted(loaded)
    assert r.stdout.count('(default: ') <= r.stdout.count('\n  --'), 'one default per option at most'
