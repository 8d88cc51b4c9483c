import pytest, torch
from dflash.config import DrafterConfig


@pytest.fixture
def small_config():
    "A small GQA drafter config with a sliding layer."
    return DrafterConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         intermediate_size=96, vocab_size=128, num_target_layers=6, mask_token_id=127,
                         num_hidden_layers=2, block_size=4, layer_types=['full_attention', 'sliding_attention'],
                         sliding_window=6)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
