"""Bad inputs and faults, tried as a user meets them: each gets a named error before training, or the run's outputs
are preserved. Option and run-directory cases call the commands' `main` in-process (that is all the command does before
it would load a model); cases that need a trained run share one small real run on the toy target."""
import json, os, pickle, shutil, subprocess, sys
from pathlib import Path
import pytest, torch
from safetensors.torch import load_file
from dflash.core.files import toy_target_dir, toy_data_dir, assets_dir
from dflash.train.command import main as train_main
from dflash.plan import main as plan_main
from dflash.decoding.speculate import main as speculate_main
from dflash.data.records import read_jsonl
from dflash.core.errors import DataError
from dflash.data.command import main as data_main
from conftest import SMALL, override, refused, train_cli, tree

@pytest.fixture(scope='module')
def files(tmp_path_factory):
    "Small data files and a copy of the toy target to break."
    d = tmp_path_factory.mktemp('inputs')
    lines = (toy_data_dir() / 'train.jsonl').read_text().splitlines()
    (d / 'train.jsonl').write_text('\n'.join(lines[:16]) + '\n')
    (d / 'one.jsonl').write_text(lines[16] + '\n')            # a short eval set: one conversation
    (d / 'empty.jsonl').write_text('\n\n')
    shutil.copytree(toy_target_dir(), d / 'target')
    return d


# --- 1. options: every bad value named, with what is allowed, before anything loads ---------------------------------
OPTION_CASES = [
    (['--max-grad-norm', '-1'], "--max-grad-norm = -1.0: allowed > 0"),
    (['--max-grad-norm', '0'], "--max-grad-norm = 0.0: allowed > 0"),
    (['--max-steps', '0'], "--max-steps = 0: allowed >= 1"),
    (['--max-steps', '-5'], "--max-steps = -5: allowed >= 1"),
    (['--batch-size', '-4'], "--batch-size = -4: allowed >= 1"),
    (['--batch-size', '0'], "--batch-size = 0: allowed >= 1"),
    (['--gamma', '0'], "--gamma = 0.0: allowed > 0"),
    (['--gamma', '-2'], "--gamma = -2.0: allowed > 0"),
    (['--log-every', '-1'], "--log-every = -1: allowed >= 0"),
    (['--eval-every', '-3'], "--eval-every = -3: allowed >= 0"),
    (['--save-every', '-1'], "--save-every = -1: allowed >= 0"),
    (['--keep-checkpoints', '0'], "--keep-checkpoints = 0: allowed >= 1"),
    (['--lr=-1e-3'], "--lr = -0.001: allowed >= 0"),
    (['--lr', 'nan'], "--lr = nan: allowed >= 0"),
    (['--lr', 'inf'], "--lr = inf: allowed >= 0"),
    (['--lr', 'fast'], "--lr = 'fast' (command line): not a number"),
    (['--warmup-ratio', '1.5'], "--warmup-ratio = 1.5: allowed >= 0 and < 1"),
    (['--memory-fraction', '0'], "--memory-fraction = 0.0: allowed > 0 and <= 1"),
    (['--memory-fraction', '2'], "--memory-fraction = 2.0: allowed > 0 and <= 1"),
    (['--num-layers', '0'], "--num-layers = 0: allowed >= 1"),
    (['--num-layers', '2.5'], "--num-layers = '2.5' (command line): not an integer"),
    (['--block-size', '1'], "--block-size = 1: allowed >= 2"),
    (['--num-anchors', '0'], "--num-anchors = 0: allowed >= 1"),
    (['--max-length', '1'], "--max-length = 1: allowed >= 2"),
    (['--micro-batch-size', '0'], "--micro-batch-size = 0: allowed >= 1"),
    (['--epochs', '0'], "--epochs = 0.0: allowed > 0"),
    (['--seed', '-1'], "--seed = -1: allowed >= 0"),
    (['--eval-samples', '0'], "--eval-samples = 0: allowed >= 1"),
    (['--eval-batch-size', '0'], "--eval-batch-size = 0: allowed >= 1"),
    (['--max-bad-steps', '0'], "--max-bad-steps = 0: allowed >= 1"),
    (['--spec-eval-prompts', '-1'], "--spec-eval-prompts = -1: allowed >= 0"),
    (['--spec-new-tokens', '0'], "--spec-new-tokens = 0: allowed >= 1"),
    (['--threads', '0'], "--threads = 0: allowed >= 1"),
    (['--threads', '-1'], "--threads = -1: allowed >= 1"),
    (['--attention', 'dense'], "--attention = 'dense': allowed one of sdpa, flex, eager"),
    (['--loss', 'mse'], "--loss = 'mse': allowed one of ce, dpace, dpace-confidence, dpace-continuation, kl"),
    (['--dpace-alpha', '0'], "--dpace-alpha = 0.0: allowed > 0 and <= 1"),
    (['--dpace-alpha', '1.5'], "--dpace-alpha = 1.5: allowed > 0 and <= 1"),
    (['--kl-weight', '-0.1'], "--kl-weight = -0.1: allowed >= 0 and <= 1"),
    (['--kl-weight', '2'], "--kl-weight = 2.0: allowed >= 0 and <= 1"),
    (['--kl-temperature', '0'], "--kl-temperature = 0.0: allowed > 0"),
    (['--schedule', 'linear'], "--schedule = 'linear': allowed one of cosine, wsd"),
    (['--decay-ratio', '0'], "--decay-ratio = 0.0: allowed > 0 and <= 1"),
    (['--schedule', 'wsd', '--warmup-ratio', '0.5', '--decay-ratio', '0.6'],
     "--decay-ratio = 0.6: allowed <= 1 - --warmup-ratio (0.5) with --schedule wsd"),
    (['--checkpointing', 'sometimes'], "--checkpointing = 'sometimes': allowed auto, none, all"),
    (['--checkpointing', '[0,-1]'], "--checkpointing = '[0,-1]': allowed"),
    (['--target-layer-ids', '1,3'], "--target-layer-ids = '1,3' (command line): not an integer"),
    (['--target-layer-ids', '-1'], "--target-layer-ids = [-1]: allowed >= 0"),
    (['--progress-bar', 'maybe'], "--progress-bar = 'maybe' (command line): not true or false"),
    (['--learning-rate', '1e-3'], "--learning-rate: unknown option"),
    (['--lr'], "--lr: expected one argument"),
    (['--resume', '--overwrite'], "--resume and --overwrite: choose one"),
    (['--block-size', '32', '--max-length', '16'], "--block-size = 32: allowed <= max_length (16)"),
    (['--batch-size', '4', '--micro-batch-size', '8'], "--micro-batch-size = 8: allowed <= batch_size / processes (4)"),
    (['--data', 'missing.jsonl'], "--data = 'missing.jsonl': no such file"),
    (['--eval-data', 'missing.jsonl'], "--eval-data = 'missing.jsonl': no such file"),
    (['--cache', 'no-such-cache'], "--cache = 'no-such-cache': no such directory"),
    (['--config', 'no-such.yaml'], "--config no-such.yaml: no such file"),
]


@pytest.mark.parametrize('argv,expect', OPTION_CASES, ids=[' '.join(a) for a, _ in OPTION_CASES])
def test_bad_option(tmp_path, capsys, monkeypatch, argv, expect):
    monkeypatch.chdir(tmp_path)
    refused(capsys, train_main, ['--out', str(tmp_path / 'run'), *argv], expect)
    assert not (tmp_path / 'run').exists(), "nothing is written before the options are good"


def test_every_bad_option_in_one_error(tmp_path, capsys):
    "Seven bad values: one error lists them all, each with its value and the allowed range."
    err = refused(capsys, train_main, ['--out', str(tmp_path / 'r'), '--max-steps', '0', '--max-grad-norm', '-1',
                                       '--batch-size', '-4', '--gamma', '0', '--log-every', '-1', '--lr', 'x',
                                       '--attention', 'dense'], '7 bad options')
    assert len([l for l in err.splitlines() if l.startswith('  --')]) == 7


YAML_CASES = [
    ('target_layer_ids: "1,3"\n', "--target-layer-ids = '1,3'"),
    ('batch_size: 2.5\n', "--batch-size = '2.5'"),
    ('num_layers: true\n', "--num-layers = 'true'"),
    ('lr: null\n', "lr: null"),
    ('learning_rate: 0.1\n', "'learning_rate'"),
    ('lr: [1, 2]\n', "lr = [1, 2]"),
    ('lr: {a: 1}\n', "lr = {'a': 1}"),
    ('- lr: 1\n', "expected a mapping of options, got list"),
    ('lr: [1\n', "not valid YAML at line"),
    ('max_steps: 0\nbatch_size: -1\n', "--max-steps = 0: allowed >= 1"),
    ('loss: kl\nkl_weight: 1.5\nkl_temperature: -1\n', "--kl-weight = 1.5: allowed >= 0 and <= 1"),
]


@pytest.mark.parametrize('text,expect', YAML_CASES, ids=[t.strip() for t, _ in YAML_CASES])
def test_bad_yaml(tmp_path, capsys, text, expect):
    (tmp_path / 'run.yaml').write_text(text)
    refused(capsys, train_main, ['--out', str(tmp_path / 'run'), '--config', str(tmp_path / 'run.yaml')], expect)
    assert not (tmp_path / 'run').exists()


def test_yaml_scientific_notation_is_a_float(tmp_path):
    "PyYAML reads `1e-3` as a string; the options read it as the flag `--lr 1e-3` would be."
    from dflash.train.command import parse_config
    (tmp_path / 'run.yaml').write_text('lr: 1e-3\nweight_decay: 1e-2\nloss: ce\ngamma: null\n')
    c = parse_config(['--config', str(tmp_path / 'run.yaml')])
    assert (c.lr, c.weight_decay, c.gamma) == (1e-3, 1e-2, None)


def test_yaml_objective(tmp_path):
    "The objective's options read from YAML as from flags; the flags win."
    from dflash.train.command import parse_config
    (tmp_path / 'run.yaml').write_text('loss: kl\nkl_weight: 0.5\nkl_temperature: 2\n')
    c = parse_config(['--config', str(tmp_path / 'run.yaml'), '--kl-temperature', '1.5'])
    assert (c.loss, c.kl_weight, c.kl_temperature) == ('kl', 0.5, 1.5)


def _target_case(d: Path, kind: str) -> Path:
    "A copy of the toy target broken one way."
    t = d / kind
    shutil.copytree(toy_target_dir(), t)
    if kind == 'garbage-config': (t / 'config.json').write_text('{"model_type": "qwen3",, }')
    if kind == 'no-config': (t / 'config.json').unlink()
    if kind == 'config-list': (t / 'config.json').write_text('[1, 2]')
    if kind == 'no-model-type': (t / 'config.json').write_text('{"hidden_size": 8}')
    if kind == 'truncated-weights':
        w = t / 'model.safetensors'
        w.write_bytes(w.read_bytes()[:len(w.read_bytes()) // 2])
    if kind == 'garbage-weights': (t / 'model.safetensors').write_bytes(b'\x00' * 4)
    if kind == 'no-weights': (t / 'model.safetensors').unlink()
    return t


TARGET_CASES = [('garbage-config', "config.json: not valid JSON (Expecting property name"),
                ('no-config', "no such config.json"), ('config-list', "expected a JSON object, got list"),
                ('no-model-type', "no 'model_type' field"), ('truncated-weights', "model.safetensors: truncated"),
                ('garbage-weights', "model.safetensors: not a safetensors file"),
                ('no-weights', "no *.safetensors weights")]


@pytest.mark.parametrize('kind,expect', TARGET_CASES, ids=[k for k, _ in TARGET_CASES])
def test_bad_target_directory(tmp_path, capsys, files, kind, expect):
    t = _target_case(tmp_path, kind)
    refused(capsys, train_main, ['--out', str(tmp_path / 'run'), '--target', str(t), '--data',
                                 str(files / 'train.jsonl')], '--target', expect)


@pytest.mark.parametrize('argv,expect', [
    (['--target', '{target}'], "--target needs --data FILE (chat JSONL) or --cache DIR"),
    (['--target', '{target}', '--data', '{train}', '--target-layer-ids', '1', '9'],
     "--target-layer-ids = [1, 9]: allowed 0..5 (the target has 6 layers)"),
    (['--target', '{target}', '--data', '{train}', '--target-layer-ids', '1', '1'],
     "--target-layer-ids = [1, 1]: each layer once"),
    (['--data', '{empty}'], "--data = '{empty}': empty file (no conversation)"),
    (['--eval-data', '{empty}'], "--eval-data = '{empty}': empty file (no conversation)"),
    (['--cache', '{dir}'], "manifest.json"),
    (['--cache', '{cache}', '--loss', 'kl'], "--loss = 'kl': the cache {cache} holds no final hidden state"),
    (['--cache', '{cache}', '--loss', 'tv'], "--loss = 'tv': the cache {cache} holds no final hidden state"),
    (['--cache', '{cache}', '{cache}/'], "--cache = ['{cache}', '{cache}/']: each cache once"),
    (['--cache', '{cache}', '{dir}/no-such-cache'], "--cache = '{dir}/no-such-cache': no such directory"),
    (['--cache', '{layers0}', '{layers1}'], "--cache: the caches hold different target layers ({layers0}: [0]; "
                                            "{layers1}: [1]); pass --target-layer-ids with layers all of them hold"),
    (['--target', '/no/such/model', '--data', '{train}'], "--target: model '/no/such/model': no such path"),
    (['--init-from', '{dir}'], "--init-from = '{dir}': no model.safetensors (a drafter directory, as a run exports"),
    (['--init-from', '{dir}', '--init-from-target'], "--init-from and --init-from-target: choose one"),
    (['--target', '{target}', '--skip-bad-lines'], "--skip-bad-lines: read only with --data (its malformed records)"),
], ids=['target-without-data', 'layer-id-out-of-range', 'layer-id-twice', 'empty-data', 'empty-eval-data', 'cache-without-manifest',
        'kl-from-a-cache-without-teacher', 'tv-from-a-cache-without-teacher', 'cache-given-twice', 'second-cache-missing',
        'caches-of-other-layers', 'missing-target', 'init-from-no-drafter', 'init-from-and-from-target',
        'skip-bad-lines-without-data'])
def test_bad_paths(tmp_path, capsys, files, argv, expect):
    (tmp_path / 'cache').mkdir()
    (tmp_path / 'cache' / 'manifest.json').write_text('{"format": "dflash-hidden-cache/1", "complete": true}')
    for k in (0, 1):                                   # two manifests, of one target layer each, not the same
        (tmp_path / f'layers{k}').mkdir()
        (tmp_path / f'layers{k}' / 'manifest.json').write_text(json.dumps({'layer_ids': [k]}))
    subs = dict(target=str(files / 'target'), train=str(files / 'train.jsonl'), empty=str(files / 'empty.jsonl'),
                dir=str(tmp_path), cache=str(tmp_path / 'cache'), layers0=str(tmp_path / 'layers0'),
                layers1=str(tmp_path / 'layers1'))
    argv = [a.format(**subs) for a in argv]
    refused(capsys, train_main, ['--out', str(tmp_path / 'run'), *argv], expect.format(**subs))


# --- start-up failures: each ends in one error line (exit 2) naming the file and the remedy, and leaves no run.json ---
@pytest.fixture(scope='module')
def startup_cache(tmp_path_factory, files):
    "A hidden-state cache of target layers 0, 2, 4 of the toy target over the 16 small conversations (4 shards)."
    out = tmp_path_factory.mktemp('startup') / 'cache'
    data_main(['cache', '--target', str(toy_target_dir()), '--data', str(files / 'train.jsonl'), '--out', str(out),
               '--layers', '0,2,4', '--shard-size', '4', '--max-length', '128', '--no-progress'])
    return out


def _broken_cache(cache: Path, d: Path, kind: str) -> Path:
    "A copy of `cache` broken one way."
    c = d / kind
    shutil.copytree(cache, c)
    manifest = json.loads((c / 'manifest.json').read_text())
    if kind == 'cache-truncated-shard':
        w = c / 'shard-00001.safetensors'
        w.write_bytes(w.read_bytes()[:1000])
    if kind == 'cache-missing-shard': (c / 'shard-00002.safetensors').unlink()
    if kind == 'cache-incomplete':
        (c / 'manifest.json').write_text(json.dumps({**manifest, 'complete': False, 'shards': manifest['shards'][:1]}))
    if kind == 'cache-manifest-without-layers':
        (c / 'manifest.json').write_text(json.dumps({k: v for k, v in manifest.items() if k != 'layer_ids'}))
    return c


def _startup_target(d: Path, kind: str) -> Path:
    "A target directory that is not one dflash.train can use, one way (most: a copy of the toy target)."
    from transformers import AutoConfig, AutoTokenizer, BertConfig, BertForMaskedLM
    from transformers import T5Config, T5ForConditionalGeneration, Qwen3ForSequenceClassification
    t = d / kind
    if kind == 'drafter': shutil.copytree(assets_dir() / 'toy-drafter', t)
    elif kind == 'bert': BertForMaskedLM(BertConfig(vocab_size=1024, hidden_size=64, num_hidden_layers=2,
                                                    num_attention_heads=4, intermediate_size=96)).save_pretrained(t)
    elif kind == 't5': T5ForConditionalGeneration(T5Config(vocab_size=1024, d_model=64, d_kv=16, d_ff=96, num_layers=2,
                                                           num_heads=4)).save_pretrained(t)
    elif kind == 'sequence-classifier':
        Qwen3ForSequenceClassification(AutoConfig.from_pretrained(toy_target_dir())).save_pretrained(t)
    else: shutil.copytree(toy_target_dir(), t)
    for f in ('tokenizer.json', 'tokenizer_config.json', 'chat_template.jinja'):
        if not (t / f).exists(): shutil.copy(toy_target_dir() / f, t / f)
    conf = json.loads((t / 'config.json').read_text())
    if kind == 'no-chat-template': (t / 'chat_template.jinja').unlink()
    if kind == 'bert-model-type': (t / 'config.json').write_text(json.dumps({**conf, 'model_type': 'bert'}))
    if kind == 'unknown-model-type': (t / 'config.json').write_text(json.dumps({**conf, 'model_type': 'frobnicator'}))
    if kind == 'config-not-of-weights': (t / 'config.json').write_text(json.dumps({**conf, 'vocab_size': 2048}))
    if kind == 'no-tokenizer':
        for f in ('tokenizer.json', 'tokenizer_config.json', 'chat_template.jinja'): (t / f).unlink()
    if kind == 'garbage-tokenizer': (t / 'tokenizer.json').write_text('{"version": "1.0", "model": 42}')
    if kind == 'other-tokenizer':
        tok = AutoTokenizer.from_pretrained(t)
        tok.add_tokens([f'<extra_{i}>' for i in range(100)])
        tok.save_pretrained(t)
    if kind == 'other-weights':
        from safetensors.torch import save_file
        w = load_file(t / 'model.safetensors')
        w['model.norm.weight'] = w['model.norm.weight'] + 1
        save_file(w, t / 'model.safetensors', metadata={'format': 'pt'})
    return t


STARTUP_CASES = [
    ('cache-other-layers', ['--cache', '{cache}', '--target-layer-ids', '1', '3'],
     "--target-layer-ids = [1, 3]: the cache {cache} holds target layers [0, 2, 4]; choose among them"),
    ('cache-other-target', ['--cache', '{cache}', '--target', '{target:other-weights}'],
     "was written for target", "train with the target it was written for, or write a cache of this one"),
    ('cache-truncated-shard', ['--cache', '{cache:cache-truncated-shard}'],
     "shard shard-00001.safetensors is truncated or corrupt", "it redoes the shards that are not whole"),
    ('cache-missing-shard', ['--cache', '{cache:cache-missing-shard}'],
     "shard shard-00002.safetensors is missing; run"),
    ('cache-incomplete', ['--cache', '{cache:cache-incomplete}'], "incomplete, 1 of 4 shards written; rerun"),
    ('cache-manifest-without-layers', ['--cache', '{cache:cache-manifest-without-layers}'],
     "manifest.json: no layer_ids; not a manifest `python -m dflash.data cache` writes"),
    ('cache-cut-leaves-no-anchor', ['--cache', '{cache}', '--max-length', '16'],
     "--max-length 16: no sample of the cache", "raise --max-length"),
    ('no-chat-template', ['--target', '{target:no-chat-template}', '--data', '{train}'],
     "its tokenizer has no chat template", "or write a cache with `python -m dflash.data cache --chat-template FILE"),
    ('bert-model-type', ['--target', '{target:bert-model-type}', '--data', '{train}'],
     "model_type 'bert' is an encoder", "DFlash drafts for decoder-only causal LMs"),
    ('bert', ['--target', '{target:bert}', '--data', '{train}'], "model_type 'bert' is an encoder"),
    ('t5', ['--target', '{target:t5}', '--data', '{train}'], "model_type 't5' is not a causal LM"),
    ('unknown-model-type', ['--target', '{target:unknown-model-type}', '--data', '{train}'],
     "model_type 'frobnicator' is not one this transformers knows", "trust_remote_code"),
    ('drafter-as-target', ['--target', '{target:drafter}', '--data', '{train}'],
     "a DFlash drafter (architectures DFlashDraftModel), not a target: pass the model it drafts for"),
    ('sequence-classifier', ['--target', '{target:sequence-classifier}', '--data', '{train}'],
     "its files lack weights of the model config.json describes (1, like lm_head.weight)"),
    ('config-not-of-weights', ['--target', '{target:config-not-of-weights}', '--data', '{train}'],
     "weights have other shapes than config.json gives", "[1024, 128] in the files, [2048, 128] by config.json"),
    ('no-tokenizer', ['--target', '{target:no-tokenizer}', '--data', '{train}'],
     "no tokenizer there", "put the model's own tokenizer files beside it"),
    ('garbage-tokenizer', ['--target', '{target:garbage-tokenizer}', '--data', '{train}'],
     "its tokenizer does not load (KeyError"),
    ('other-tokenizer', ['--target', '{target:other-tokenizer}', '--data', '{train}'],
     "its tokenizer has 1100 tokens, more than the model's vocab_size (1024 in config.json)"),
    ('garbage-data', ['--data', '{garbage}'], "garbage.jsonl:1: malformed JSON line"),
    ('garbage-eval-data', ['--data', '{train}', '--eval-data', '{garbage}'], "garbage.jsonl:1: malformed JSON line"),
    ('data-is-a-directory', ['--data', '{dir}'], "--data = '{dir}': not a file"),
    ('config-is-a-directory', ['--config', '{dir}'], "--config {dir}: not a file"),
    ('config-not-utf8', ['--config', '{garbage}'], "garbage.jsonl: not valid YAML ('utf-8' codec can't decode"),
    ('max-length-leaves-no-anchor', ['--data', '{train}', '--max-length', '16'],
     "train.jsonl: no usable sample among 16 records", "within max_length=16"),
    ('num-layers-above-target', ['--data', '{train}', '--num-layers', '12'],
     "--num-layers = 12: allowed <= 6 without --target-layer-ids"),
    ('flex-attention-on-cpu', ['--data', '{train}', '--attention', 'flex'],
     "--attention flex: torch has no FlexAttention backward on CPU"),
]


def _startup_subs(arg: str, d: Path, files: Path, cache: Path) -> str:
    "`arg` with {cache}, {cache:KIND}, {target:KIND}, {train}, {garbage}, {dir} made: the paths of one case."
    kind = arg[1:-1].partition(':')[2]
    if arg.startswith('{target:'): return str(_startup_target(d, kind))
    if arg.startswith('{cache:'): return str(_broken_cache(cache, d, kind))
    (d / 'garbage.jsonl').write_bytes(bytes(range(256)) * 4)
    (d / 'dir').mkdir(exist_ok=True)
    return arg.format(cache=cache, train=files / 'train.jsonl', garbage=d / 'garbage.jsonl', dir=d / 'dir')


@pytest.mark.parametrize('kind,argv,expect', [(k, a, e) for k, a, *e in STARTUP_CASES],
                         ids=[c[0] for c in STARTUP_CASES])
def test_startup_failure(tmp_path, capsys, files, startup_cache, kind, argv, expect):
    "A target, tokenizer, cache or data file the run cannot use: one error line, exit 2, no run.json and no lock."
    if kind == 'flex-attention-on-cpu' and torch.cuda.is_available(): pytest.skip("FlexAttention trains on a GPU")
    argv = [_startup_subs(a, tmp_path, files, startup_cache) for a in argv]
    out = tmp_path / 'run'
    subs = dict(cache=startup_cache, dir=tmp_path / 'dir')
    refused(capsys, train_main, ['--out', str(out), *override(SMALL, *argv)], *[e.format(**subs) for e in expect])
    assert not (out / 'run.json').exists() and not (out / '.lock').exists()


UNREADABLE = [('data', "--data = '{path}': cannot read it (Permission denied)"),
              ('config', "--config {path}: cannot read it (Permission denied)"),
              ('target-tokenizer', "--target: {path}: cannot read it (Permission denied)"),
              ('cache-manifest', "--cache: {path}: cannot read it (Permission denied)"),
              ('cache-shard', "cache {path}: cannot read it (Permission denied)")]


@pytest.mark.parametrize('kind,expect', UNREADABLE, ids=[k for k, _ in UNREADABLE])
def test_startup_failure_unreadable(tmp_path, files, startup_cache, kind, expect):
    "A file the run must read and may not (its permission bits, which hold for root in `train_cli`): named, exit 2."
    shutil.copy(files / 'train.jsonl', tmp_path / 'train.jsonl')
    (tmp_path / 'run.yaml').write_text('lr: 0.001\n')
    shutil.copytree(toy_target_dir(), tmp_path / 'target')
    shutil.copytree(startup_cache, tmp_path / 'cache')
    path = {'data': tmp_path / 'train.jsonl', 'config': tmp_path / 'run.yaml',
            'target-tokenizer': tmp_path / 'target' / 'tokenizer.json',
            'cache-manifest': tmp_path / 'cache' / 'manifest.json',
            'cache-shard': tmp_path / 'cache' / 'shard-00001.safetensors'}[kind]
    path.chmod(0)
    source = ['--cache', tmp_path / 'cache'] if kind.startswith('cache') else ['--data', tmp_path / 'train.jsonl']
    r = train_cli('--out', tmp_path / 'run', '--target', tmp_path / 'target', *source, '--config',
                  tmp_path / 'run.yaml', *SMALL)
    assert r.returncode == 2 and 'Traceback' not in r.stderr and expect.format(path=path) in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / 'run' / 'run.json').exists()


def test_out_is_a_file(tmp_path, capsys):
    (tmp_path / 'run').write_text('not a directory')
    refused(capsys, train_main, ['--out', str(tmp_path / 'run')], "exists and is not a directory")


# --- 2. the other commands validate the same way --------------------------------------------------------------------
@pytest.fixture(scope='module')
def plan_config(tmp_path_factory):
    d = tmp_path_factory.mktemp('plan')
    shutil.copy(toy_target_dir() / 'config.json', d / 'config.json')
    (d / 'garbage.json').write_text('{"model_type": ')
    return d


@pytest.mark.parametrize('argv,expect', [
    (['--seq-len', '0'], "--seq-len = 0: allowed >= 1"),
    (['--anchors', '-3'], "--anchors = -3: allowed >= 1"),
    (['--layers', '0'], "--layers = 0: allowed >= 1"),
    (['--block-size', '1'], "--block-size = 1: allowed >= 2"),
    (['--memory', '12XB'], "--memory: memory size '12XB' is not understood"),
    (['--dtype', 'fp8'], "--dtype = 'fp8': allowed one of float32, fp32, bfloat16, bf16, float16, fp16"),
    (['--policies', '0'], "--policies: checkpointing policy 0: every k-th layer needs k >= 1"),
    (['--micro-batch-size', 'two'], "--micro-batch-size = 'two' (command line): not an integer"),
    (['--target-config', '{d}/garbage.json'], "not valid JSON"),
    (['--target-config', '{d}/missing.json'], "missing.json: no such config.json"),
], ids=['seq-len-0', 'anchors-negative', 'layers-0', 'block-1', 'memory-unit', 'dtype', 'policy-0', 'micro-text',
        'garbage-config', 'missing-config'])
def test_plan_bad_option(capsys, plan_config, argv, expect):
    base = ['--target-config', str(plan_config / 'config.json')]
    refused(capsys, plan_main, base + [a.format(d=plan_config) for a in argv], expect)


def test_plan_needs_a_target_config(capsys):
    refused(capsys, plan_main, ['--seq-len', '0'], "--target-config is required", "--seq-len = 0")


def _drafter_case(d: Path, kind: str) -> Path:
    "A copy of the shipped toy drafter broken one way."
    t = d / kind
    shutil.copytree(assets_dir() / 'toy-drafter', t)
    conf = json.loads((t / 'config.json').read_text())
    if kind == 'non-numeric-field': (t / 'config.json').write_text(json.dumps({**conf, 'hidden_size': 'abc'}))
    if kind == 'non-numeric-mask':
        dc = {**conf['dflash_config'], 'mask_token_id': 'm'}
        (t / 'config.json').write_text(json.dumps({**conf, 'dflash_config': dc}))
    if kind == 'garbage-config': (t / 'config.json').write_bytes(b'\xff\xfe not json')
    if kind == 'truncated-weights':
        w = t / 'model.safetensors'
        w.write_bytes(w.read_bytes()[:-1000])
    if kind == 'no-weights': (t / 'model.safetensors').unlink()
    return t


@pytest.mark.parametrize('kind,expect', [
    ('non-numeric-field', "fields that must be numbers are not: hidden_size='abc'"),
    ('non-numeric-mask', "dflash_config.mask_token_id='m'"),
    ('garbage-config', "config.json: not UTF-8 text"),
    ('truncated-weights', "model.safetensors: truncated"),
    ('no-weights', "model.safetensors: no such file")])
def test_speculate_bad_drafter(tmp_path, capsys, kind, expect):
    d = _drafter_case(tmp_path, kind)
    refused(capsys, speculate_main, ['--target', str(toy_target_dir()), '--drafter', str(d), '--data',
                                     str(toy_data_dir() / 'eval.jsonl')], '--drafter', expect)


@pytest.mark.parametrize('argv,expect', [
    (['--num-prompts', '0'], "--num-prompts = 0: allowed >= 1"),
    (['--max-new-tokens', '-1'], "--max-new-tokens = -1: allowed >= 1"),
    (['--block-size', '1'], "--block-size = 1: allowed >= 2"),
    (['--dtype', 'int8'], "--dtype = 'int8': allowed one of float32, fp32, bfloat16, bf16, float16, fp16"),
    (['--data', 'missing.jsonl'], "--data = 'missing.jsonl': no such file"),
    (['--temperature', '0', '-0.5'], "--temperature = [0.0, -0.5]: allowed 0 or >= 0.01"),
    (['--top-p', '0'], "--top-p = 0.0: allowed > 0 and <= 1"),
    (['--top-p', '1.5'], "--top-p = 1.5: allowed > 0 and <= 1"),
], ids=['prompts-0', 'new-tokens', 'block-1', 'dtype', 'missing-data', 'temperature', 'top-p-0', 'top-p-high'])
def test_speculate_bad_option(capsys, argv, expect):
    base = ['--target', str(toy_target_dir()), '--drafter', str(assets_dir() / 'toy-drafter'),
            '--data', str(toy_data_dir() / 'eval.jsonl')]
    refused(capsys, speculate_main, base + argv, expect)


def test_truncated_drafter_loaded_directly_is_named(tmp_path):
    from dflash.model.drafter import DFlashDrafter
    d = _drafter_case(tmp_path, 'truncated-weights')
    with pytest.raises(ValueError, match='model.safetensors: unreadable, truncated or not safetensors'):
        DFlashDrafter.from_pretrained(d)


# --- 3. data: unencodable text and malformed lines are named by file:line -------------------------------------------
@pytest.mark.parametrize('line,expect', [
    ('{"messages": [{"role": "user", "content": "hi \\ud800"}, {"role": "assistant", "content": "x"}]}',
     "text that is not valid Unicode (surrogates not allowed: '\\ud800')"),
    ('{"messages": [{"role": "user", "content": "hi"}, ', "malformed JSON line"),
    (b'{"messages": "\xff\xfe"}', "malformed JSON line"),
    ('[1, 2, 3]', "expected a JSON object, got list"),
], ids=['lone-surrogate', 'cut-line', 'invalid-utf8', 'not-an-object'])
def test_bad_data_line_is_named(tmp_path, line, expect):
    good = (toy_data_dir() / 'eval.jsonl').read_text().splitlines()[0]
    p = tmp_path / 'bad.jsonl'
    p.write_bytes(good.encode() + b'\n' + (line if isinstance(line, bytes) else line.encode()) + b'\n')
    with pytest.raises(DataError, match=f"bad.jsonl:2: ") as e: list(read_jsonl(p))
    assert expect in str(e.value), str(e.value)


def test_training_on_a_lone_surrogate_names_file_and_line(tmp_path, capsys, files):
    "The same through the training command: the error names the line before any step is taken."
    p = tmp_path / 'train.jsonl'
    lines = (files / 'train.jsonl').read_text().splitlines()
    p.write_text('\n'.join(lines[:5] + ['{"messages": [{"role": "user", "content": "\\udc80"}]}'] + lines[5:]) + '\n')
    refused(capsys, train_main, ['--out', str(tmp_path / 'run'), '--data', str(p), *SMALL, '--max-steps', '1'],
            'train.jsonl:6: text that is not valid Unicode')
    assert not (tmp_path / 'run' / 'checkpoints').exists() and not (tmp_path / 'run' / 'run.json').exists()


def test_train_set_smaller_than_a_batch(tmp_path, capsys, files):
    refused(capsys, train_main, ['--out', str(tmp_path / 'run'), '--data', str(files / 'one.jsonl'),
                                 *override(SMALL, '--batch-size', '16')], '--batch-size 16 is larger than the training set (1 samples)')
    assert not (tmp_path / 'run' / 'run.json').exists()


def test_eval_set_with_no_usable_conversation(tmp_path, capsys, files):
    (tmp_path / 'ev.jsonl').write_text('{"messages": [{"role": "user", "content": "only a question"}]}\n')
    refused(capsys, train_main, ['--out', str(tmp_path / 'run'), '--data', str(files / 'train.jsonl'), '--eval-data',
                                 str(tmp_path / 'ev.jsonl'), *SMALL], 'ev.jsonl: no usable sample among 1 records')
    assert not (tmp_path / 'run' / 'run.json').exists()


# --- 4. a real run, and what may and may not happen to it -----------------------------------------------------------
RUN = SMALL + ['--max-steps', '4', '--save-every', '2', '--keep-checkpoints', '3', '--eval-every', '2']


@pytest.fixture(scope='module')
def finished(tmp_path_factory, files):
    "A finished run on the toy target with a one-conversation eval set (which once crashed the final evaluation)."
    out = tmp_path_factory.mktemp('runs') / 'finished'
    summary = train_main(['--out', str(out), '--data', str(files / 'train.jsonl'), '--eval-data',
                          str(files / 'one.jsonl'), *RUN])
    assert 'eval_loss' in summary['metrics'] and (out / 'drafter' / 'model.safetensors').is_file()
    assert json.loads((out / 'run.json').read_text())['status'] == 'finished'
    return out


def _copy(run: Path, dest: Path, unfinished: bool = True) -> Path:
    "A copy of the run; `unfinished`: as if it had been killed after its last checkpoint, before the export."
    shutil.copytree(run, dest)
    if unfinished:
        shutil.rmtree(dest / 'drafter')
        (dest / 'summary.json').unlink()
        rec = json.loads((dest / 'run.json').read_text())
        (dest / 'run.json').write_text(json.dumps({**rec, 'status': 'running'}))
    return dest


def test_new_run_into_a_run_is_refused(tmp_path, capsys, finished):
    run = _copy(finished, tmp_path / 'run', unfinished=False)
    before = tree(run)
    refused(capsys, train_main, ['--out', str(run), *RUN], 'holds a run',
            'pass --resume to continue it, or --overwrite')
    assert tree(run) == before


def test_resume_of_a_finished_run_changes_nothing(tmp_path, capsys, finished):
    run = _copy(finished, tmp_path / 'run', unfinished=False)
    before = tree(run)
    assert train_main(['--out', str(run), '--resume']) == {}
    assert 'this run finished at step 4; --resume leaves it as it is' in capsys.readouterr().out
    assert tree(run) == before


def test_resume_with_changed_layout_is_refused(tmp_path, capsys, finished, files):
    run = _copy(finished, tmp_path / 'run')
    before = tree(run)
    refused(capsys, train_main, ['--out', str(run), '--resume', '--batch-size', '8', '--num-layers', '3', '--seed', '1',
                                 '--data', str(toy_data_dir() / 'eval.jsonl')],
            '4 bad options', "--batch-size = 8: the run was started with 4", "--num-layers = 3", "--seed = 1", "--data")
    assert tree(run) == before


def test_run_directory_in_use_is_refused(tmp_path, capsys, finished):
    run = _copy(finished, tmp_path / 'run')
    holder = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
    try:
        (run / '.lock').write_text(json.dumps({'pid': holder.pid, 'host': os.uname().nodename, 'started': 'now'}))
        before = tree(run)
        refused(capsys, train_main, ['--out', str(run), '--resume'], f'is in use by process {holder.pid}')
        assert tree(run) == before
    finally:
        holder.kill()
        holder.wait()


def test_unreadable_lock_is_refused(tmp_path, capsys, finished):
    run = _copy(finished, tmp_path / 'run')
    (run / '.lock').write_text('')
    refused(capsys, train_main, ['--out', str(run), '--resume'], '.lock: unreadable lock')


@pytest.mark.parametrize('text,expect', [('{"config": ', 'run.json: not valid JSON'),
                                         ('{"status": "running"}', "run.json: no 'config' mapping")],
                         ids=['garbage', 'no-config'])
def test_bad_run_record(tmp_path, capsys, finished, text, expect):
    run = _copy(finished, tmp_path / 'run')
    (run / 'run.json').write_text(text)
    refused(capsys, train_main, ['--out', str(run), '--resume'], expect)


def test_overwrite_moves_the_old_run_aside(tmp_path, finished, files):
    run = _copy(finished, tmp_path / 'run', unfinished=False)
    before = tree(run)
    train_main(['--out', str(run), '--overwrite', '--data', str(files / 'train.jsonl'), '--eval-data',
                str(files / 'one.jsonl'), *SMALL, '--max-steps', '1'])
    moved = [p for p in tmp_path.iterdir() if p.name.startswith('run.replaced-')]
    assert len(moved) == 1 and tree(moved[0]) == before, "the old run is kept whole"
    assert json.loads((run / 'run.json').read_text())['status'] == 'finished' and not (run / '.lock').exists()


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path, capsys, finished):
    run = _copy(finished, tmp_path / 'run')
    dead = subprocess.Popen([sys.executable, '-c', 'pass'])
    dead.wait()
    (run / '.lock').write_text(json.dumps({'pid': dead.pid, 'host': os.uname().nodename, 'started': 'then'}))
    train_main(['--out', str(run), '--resume'])
    assert f'process {dead.pid} (started then) is gone; taking over its stale lock' in capsys.readouterr().out
    assert (run / 'drafter' / 'model.safetensors').is_file() and not (run / '.lock').exists()


# --- 5. checkpoints: corrupt ones are named and skipped, and nothing in them is unpickled ---------------------------
def _corrupt(ckpt: Path, kind: str):
    if kind == 'garbage-state': (ckpt / 'trainer_state.json').write_text('{"step": 4,')
    if kind == 'state-not-object': (ckpt / 'trainer_state.json').write_text('[4]')
    if kind == 'old-format-state': (ckpt / 'trainer_state.json').write_text('{"step": 4, "bad_steps": 0}')
    if kind == 'no-state': (ckpt / 'trainer_state.json').unlink()
    if kind == 'truncated-model':
        w = ckpt / 'model.safetensors'
        w.write_bytes(w.read_bytes()[:-64])
    if kind == 'truncated-optimizer':
        w = ckpt / 'optimizer.safetensors'
        w.write_bytes(w.read_bytes()[:100])
    if kind == 'flipped-byte':
        w = ckpt / 'model.safetensors'
        b = bytearray(w.read_bytes())
        b[-5] ^= 0xFF
        w.write_bytes(bytes(b))
    if kind == 'missing-model': (ckpt / 'model.safetensors').unlink()


CORRUPT = [('garbage-state', 'trainer_state.json: not valid JSON'), ('state-not-object', 'expected a JSON object'),
           ('old-format-state', "no 'step' and 'files' checksums"), ('no-state', 'no such trainer_state.json'),
           ('truncated-model', 'model.safetensors: corrupt'), ('truncated-optimizer', 'optimizer.safetensors: corrupt'),
           ('flipped-byte', 'model.safetensors: corrupt'), ('missing-model', 'model.safetensors: missing')]


@pytest.fixture(scope='module')
def resumer(finished):
    "A trainer of the finished run's options, to resume from broken copies of it."
    from dflash.train.trainer import Trainer
    from dflash.core.schema import TrainConfig
    rec = json.loads((finished / 'run.json').read_text())
    return Trainer(TrainConfig(**{**rec['config'], 'resume': True}))


@pytest.mark.parametrize('kind,expect', CORRUPT, ids=[k for k, _ in CORRUPT])
def test_corrupt_newest_checkpoint_falls_back(tmp_path, capsys, finished, resumer, kind, expect):
    run = _copy(finished, tmp_path / 'run')
    _corrupt(run / 'checkpoints' / 'step-0000004', kind)
    resumer.out = run
    assert resumer.resume().name == 'step-0000002' and resumer.step == 2
    out = capsys.readouterr().out
    assert 'step-0000004 is unusable' in out and expect in out and 'trying an older one' in out, out


def test_no_intact_checkpoint_names_each(tmp_path, resumer, finished):
    from dflash.core.errors import CheckpointError
    run = _copy(finished, tmp_path / 'run')
    _corrupt(run / 'checkpoints' / 'step-0000004', 'truncated-model')
    _corrupt(run / 'checkpoints' / 'step-0000002', 'garbage-state')
    resumer.out = run
    with pytest.raises(CheckpointError, match='no intact checkpoint') as e: resumer.resume()
    assert 'step-0000004' in str(e.value) and 'step-0000002' in str(e.value)


class _Payload:
    "Unpickling this runs a shell command that leaves a marker file."
    def __init__(self, marker): self.marker = marker
    def __reduce__(self): return (os.system, (f'touch {self.marker}',))


def test_planted_pickles_never_run_and_resume_falls_back_exactly(tmp_path, capsys, finished):
    "Payloads where accelerate would read pickles; a corrupt newest checkpoint; the resumed run equals the original."
    marker = tmp_path / 'payload-ran'
    payload = pickle.dumps(_Payload(marker))
    pickle.loads(payload)
    assert marker.exists(), "the payload does run when unpickled"
    marker.unlink()
    run = _copy(finished, tmp_path / 'run')
    for ckpt in (run / 'checkpoints').iterdir():
        for name in ('custom_checkpoint_0.pkl', 'random_states_0.pkl', 'optimizer.bin', 'scheduler.bin',
                     'pytorch_model.bin', 'sampler.bin'):
            (ckpt / name).write_bytes(payload)
    for name in ('custom_checkpoint_0.pkl', 'training_args.bin'): (run / name).write_bytes(payload)
    _corrupt(run / 'checkpoints' / 'step-0000004', 'truncated-model')
    summary = train_main(['--out', str(run), '--resume'])
    assert not marker.exists(), "no planted pickle was loaded"
    assert 'resumed from' in capsys.readouterr().out and summary['metrics']['step'] == 4
    a, b = load_file(run / 'drafter' / 'model.safetensors'), load_file(finished / 'drafter' / 'model.safetensors')
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "resuming from step 2 is exact"
    import csv
    assert [int(r['step']) for r in csv.DictReader((run / 'metrics.csv').read_text().splitlines())] == [1, 2, 3, 4]
    assert [int(r['step']) for r in csv.DictReader((run / 'eval.csv').read_text().splitlines())] == [2, 4]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(str(run / 'tensorboard'))
    ea.Reload()
    for tag in ('loss', 'eval_loss'):
        steps = [e.step for e in ea.Scalars(tag)]
        assert steps == sorted(set(steps)), (tag, steps)


def test_allowed_changes_on_resume_are_applied_and_logged(tmp_path, capsys, finished):
    run = _copy(finished, tmp_path / 'run')
    shutil.rmtree(run / 'checkpoints' / 'step-0000004')
    train_main(['--out', str(run), '--resume', '--lr', '1e-3', '--max-steps', '5', '--log-every', '2'])
    assert "changed on resume: lr 0.003 -> 0.001, max_steps 4 -> 5, log_every 1 -> 2" in capsys.readouterr().out
    rec = json.loads((run / 'run.json').read_text())
    assert rec['config']['lr'] == 1e-3 and rec['resumes'][-1]['changed']['max_steps'] == [4, 5]
    assert rec['status'] == 'finished' and rec['step'] == 5
    import csv
    rows = {int(r['step']): float(r['lr']) for r in csv.DictReader((run / 'metrics.csv').read_text().splitlines())}
    assert sorted(rows) == [1, 2, 4, 5], "logged every 2 steps after the resume, and the last step"
    assert 0 < rows[4] <= 1e-3 < rows[2], "the new peak learning rate is applied"


def test_non_finite_steps_keep_the_last_good_checkpoint(tmp_path, capsys, finished):
    "A resume at a huge learning rate goes non-finite; saves stop, rotation keeps the last good checkpoint, it aborts."
    from dflash.train.checkpoints import verify_checkpoint, checkpoint_dirs
    run = _copy(finished, tmp_path / 'run')
    shutil.rmtree(run / 'checkpoints' / 'step-0000004')
    with pytest.raises(SystemExit) as e:
        train_main(['--out', str(run), '--resume', '--lr', '1e30', '--max-grad-norm', '1e30', '--max-steps', '40',
                    '--save-every', '1', '--keep-checkpoints', '1', '--max-bad-steps', '3', '--eval-every', '0'])
    said = capsys.readouterr()
    assert e.value.code == 1 and 'error: step' in said.err and '3 non-finite steps in a row' in said.err, said.err
    good = [d for d in checkpoint_dirs(run) if verify_checkpoint(d)['bad_steps'] == 0]
    assert good, "a good checkpoint survives"
    assert all(verify_checkpoint(d)['bad_steps'] == 0 for d in checkpoint_dirs(run)), "none written mid-streak"
    assert 'no checkpoint during' in said.out
    assert not (run / '.lock').exists(), "the lock is released when the run fails"


def test_rotation_never_deletes_the_last_good_checkpoint(tmp_path):
    from dflash.train.checkpoints import rotate_checkpoints, checkpoint_dirs
    for step, bad in [(2, 0), (4, 0), (6, 2), (8, 3)]:
        d = tmp_path / 'checkpoints' / f'step-{step:07d}'
        d.mkdir(parents=True)
        (d / 'trainer_state.json').write_text(json.dumps({'step': step, 'bad_steps': bad, 'files': {}}))
    rotate_checkpoints(tmp_path, keep=1)
    assert [d.name for d in checkpoint_dirs(tmp_path)] == ['step-0000004', 'step-0000008']


@pytest.mark.parametrize('argv,expect', [
    (['tokenize', '--max-length', '0'], "--max-length = 0: allowed >= 1"),
    (['tokenize', '--num-proc', '0'], "--num-proc = 0: allowed >= 1"),
    (['tokenize', '--max-length', 'long'], "--max-length = 'long' (command line): not an integer"),
    (['tokenize', '--data', 'missing.jsonl'], "--data = 'missing.jsonl': no such file"),
    (['tokenize', '--target', 'no/such-model'], "--target: model 'no/such-model'"),
    (['tokenize', '--chat-template', 'missing.jinja'], "--chat-template = 'missing.jinja': no such file"),
    (['tokenize', '--shard-size', '4'], "--shard-size: unknown option"),
    (['cache', '--shard-size', '0'], "--shard-size = 0: allowed >= 1"),
    (['cache', '--batch-tokens', '-1'], "--batch-tokens = -1: allowed >= 1"),
    (['cache', '--layers', '1;3'], "--layers = '1;3': allowed comma-separated layer ids >= 0"),
    (['cache', '--layers', '1,-3'], "--layers = '1,-3': allowed comma-separated layer ids >= 0"),
    (['cache', '--dtype', 'fp8'], "--dtype = 'fp8': allowed one of auto, float32, fp32, bfloat16, bf16, float16, fp16"),
    (['cache', '--num-draft-layers', '0'], "--num-draft-layers = 0: allowed >= 1"),
    (['cachez'], "'cachez': unknown command; one of tokenize, cache"),
], ids=['max-length-0', 'num-proc-0', 'max-length-text', 'missing-data', 'missing-target', 'missing-template',
        'option-of-another-command', 'shard-size-0', 'batch-tokens', 'layers-text', 'layers-negative', 'dtype',
        'draft-layers-0', 'unknown-command'])
def test_data_bad_option(tmp_path, capsys, files, argv, expect):
    "`python -m dflash.data`: each bad value named with what is allowed, before the tokenizer or the target loads."
    cmd, rest = argv[0], argv[1:]
    base = ['--target', str(files / 'target'), '--data', str(files / 'train.jsonl')]
    base += ['--out', str(tmp_path / 'cache')] if cmd == 'cache' else []
    refused(capsys, data_main, [cmd, *base, *rest] if cmd in ('tokenize', 'cache') else argv, expect)
    assert not (tmp_path / 'cache').exists()


def test_data_every_bad_option_in_one_error(tmp_path, capsys):
    err = refused(capsys, data_main, ['cache', '--max-length', '0', '--layers', 'x', '--shard-size', '-2'],
                  '6 bad options', '--target is required', '--data is required', '--out is required',
                  '--max-length = 0', "--layers = 'x'", '--shard-size = -2')
    assert err.count('\n  ') == 6, err



@pytest.mark.parametrize('argv,expect', [
    (['attention', '--seq-len', '0'], "--seq-len = 0: allowed >= 1"),
    (['attention', '--layouts', 'diagonal'], "--layouts = ['diagonal']: allowed one of uniform, half, quarter"),
    (['attention', '--budget', '-1'], "--budget = -1.0: allowed > 0"),
    (['scaling', '--seq-lens', '1024', '0'], "--seq-lens = [1024, 0]: allowed >= 1"),
    (['step', '--policies', 'none', 'most'], "--policies = 'most': allowed none, all, an integer k >= 1"),
    (['step', '--threads', '-1'], "--threads = -1: allowed >= 0"),
    (['train', '--machines', '0'], "--machines = 0: allowed >= 1"),
    (['train', '--processes', '2', '--machines', '3'], "--machines = 3: allowed a divisor of the most --processes (2)"),
    (['train', '--batch-size', '3'], "--batch-size = 3: allowed a multiple of every --processes (not of [2])"),
    (['train', '--steps', '2', '--warmup-steps', '2'], "--steps = 2: allowed > --warmup-steps (2)"),
    (['regenerate', '--n', 'many'], "--n = 'many' (command line): not an integer"),
    (['data', '--processes', '0'], "--processes = [0]: allowed >= 1"),
    (['gpu', '--dry-run', '--seed', '1'], "--seed: unknown option"),
    (['atention'], "'atention': unknown command; one of attention, scaling, step, train, regenerate, data, quality, gpu"),
], ids=['seq-len-0', 'layout', 'budget', 'seq-lens', 'policy', 'threads', 'machines-0', 'machines-split',
        'batch-split', 'no-measured-step', 'n-text', 'processes-0', 'option-of-another-command', 'unknown-command'])
def test_bench_bad_option(capsys, argv, expect):
    "`python -m dflash.bench`: each bad value named with what is allowed, before torch or a model loads."
    from dflash.bench.command import main as bench_main
    refused(capsys, bench_main, argv, expect)


def test_bench_every_bad_option_in_one_error(capsys):
    from dflash.bench.command import main as bench_main
    err = refused(capsys, bench_main, ['train', '--machines', '0', '--threads', 'x', '--batch-size', '3'],
                  '3 bad options', "--threads = 'x' (command line): not an integer", '--machines = 0: allowed >= 1',
                  '--batch-size = 3: allowed a multiple of every --processes')
    assert err.count('\n  ') == 3, err

# --- 6. the same errors from real processes, as a shell user sees them ----------------------------------------------
@pytest.mark.parametrize('module,argv,expect', [
    ('dflash.train', ['--max-steps', '0', '--lr', 'abc'], "2 bad options"),
    ('dflash.plan', ['--target-config', str(toy_target_dir()), '--seq-len', '0'], "--seq-len = 0: allowed >= 1"),
    ('dflash.speculate', ['--num-prompts', '0'], "--num-prompts = 0: allowed >= 1"),
    ('dflash.data', ['cache', '--target', str(toy_target_dir()), '--data', 'missing.jsonl', '--out', 'c'],
     "--data = 'missing.jsonl': no such file"),
    ('dflash.data', [], "usage: python -m dflash.data {tokenize,cache"),
    ('dflash.bench', ['train', '--machines', '0', '--steps', '1'], "2 bad options"),
    ('dflash.bench', [], "usage: python -m dflash.bench {attention,scaling,step,train,regenerate,data,quality,gpu,real,vocab,threads}"),
], ids=['train', 'plan', 'speculate', 'data', 'data-no-command', 'bench', 'bench-no-command'])
def test_command_exits_2_with_the_error(tmp_path, module, argv, expect):
    r = subprocess.run([sys.executable, '-m', module, *argv], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and expect in r.stderr and 'Traceback' not in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == [], "nothing written"


def test_report_to_a_tracker_not_installed_is_refused(tmp_path, capsys, monkeypatch):
    "A tracker whose package is missing: exit 2 with the options' error, before the target loads or `out` is made."
    import importlib.util
    from dflash.core.schema import TRACKERS
    missing = [t for t, package in TRACKERS.items() if package and importlib.util.find_spec(package) is None]
    if not missing: pytest.skip("every tracker package accelerate knows is installed here")
    monkeypatch.chdir(tmp_path)
    refused(capsys, train_main, ['--out', str(tmp_path / 'run'), '--report-to', missing[0]],
            f"--report-to = {missing[0]!r}: the {TRACKERS[missing[0]]} package is not installed")
    assert not (tmp_path / 'run').exists()


def test_speculate_sampling_options_together(capsys):
    "Every bad sampling option is named in one error, before any model loads."
    base = ['--target', str(toy_target_dir()), '--drafter', str(assets_dir() / 'toy-drafter'),
            '--data', str(toy_data_dir() / 'eval.jsonl')]
    refused(capsys, speculate_main, base + ['--temperature', '-1', '--top-p', '2', '--seed', '-3'], '3 bad options',
            "--temperature = [-1.0]: allowed 0 or >= 0.01", "--top-p = 2.0: allowed > 0 and <= 1", "--seed = -3: allowed >= 0")
