"""Process-wide state that knobs set (as they do in a trial's own process) is put back after each
GPU test, so a test's outcome does not depend on which tests ran before it in the same worker."""

import pytest
import torch


@pytest.fixture(autouse=True)
def restore_process_state():
    import torch._inductor.config as inductor_config
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    saved = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark,
             inductor_config.save_config(), _AttentionBackendRegistry._active_backend)
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = saved[1:3]
    inductor_config.load_config(saved[3])  # the inductor_flags knob changes it
    _AttentionBackendRegistry._active_backend = saved[4]
