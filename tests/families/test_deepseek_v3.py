"""deepseek_v3 against transformers 5.24's DeepseekV3ForCausalLM at the numerical floor (q-LoRA + YaRN
interleaved, direct q + half rotary, grouped MoE with identical expert selection), the decode step replayed
natively, the latent rows against the reference's cache, and a provider without latent rows refused. The
lowering is checked in tests/frontends/test_deepseek_v3.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.families import latent_support as S
from tests.families.deepseek_v3_support import PROMPT, SPLIT, VOCAB
from tests.families.deepseek_v3_support import mini  # noqa: F401  (fixture)


# ---------------------------------------------------------------- providers


def test_provider_without_latent_rows_refuses_mla(mini):
    from vxc.passes.findings import Refusal
    from vxc.runtime.state import ROWS_ONLY, StateProvider

    for provider in (StateProvider(kinds=("recurrent", "conv_history", "kv_rows"), name="no-latent"), ROWS_ONLY):
        with pytest.raises(Refusal) as e:
            S.engine(mini["dense"], provider=provider)
        assert [(f.layer, f.operator, f.code) for f in e.value.findings] == [(i, "mla", "unsupported-region") for i in range(3)]
        assert "latent (latent_rows)" in e.value.findings[0].message


# ---------------------------------------------------------------- parity at the floor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["moe", "direct"])
@pytest.mark.native
def test_decode_replays_natively_bit_identical_to_the_graph(mini, variant, dtype):
    """MLA with q-LoRA + YaRN (interleaved, split) or a direct q (half rotary), the grouped sigmoid router with
    its selection bias and the experts all run natively for one token: the decode step is replayed bit-identically."""
    S.assert_replay_bit_identical(mini[variant], S.prompt(VOCAB, 20, seed=3), S.prompt(VOCAB, 12, seed=4), dtype)


def test_parity_qlora_yarn_interleaved(mini):
    measured = S.parity("deepseek_v3 (q-LoRA, YaRN, interleaved, dense FFN)", mini["dense"], VOCAB, S.prompt(VOCAB, PROMPT, 1), SPLIT)
    S.check_parity(*measured, PROMPT)


def test_parity_direct_q_half_rotary(mini):
    measured = S.parity("deepseek_v3 (direct q, half rotary, dense FFN)", mini["direct"], VOCAB, S.prompt(VOCAB, PROMPT, 2), SPLIT)
    S.check_parity(*measured, PROMPT)


def test_parity_grouped_moe(mini):
    p, run, want = S.parity("deepseek_v3 (grouped MoE)", mini["moe"], VOCAB, S.prompt(VOCAB, PROMPT, 3), SPLIT, moe=True)
    S.check_parity(p, run, want, PROMPT)
    assert p.experts_match, "the selected experts differ from the reference's at some token"


def test_latent_rows_match_reference_cache(mini):
    """The declared latent row is [normalised c | rotated k_pe] in the reference's order: the rows vxc
    holds after a prefill equal the compressed cache transformers keeps (its k_pe in evens-then-odds order)."""
    import transformers

    from vxc.runtime.session import Session

    ids = S.prompt(VOCAB, 29, seed=4)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(mini["dense"]), dtype=torch.float32).eval()
    with torch.no_grad():
        cache = model(torch.tensor([ids]), use_cache=True).cache
    eng = S.engine(mini["dense"])
    Session(eng).prefill(ids)
    for i in range(3):
        rows = eng.state.buffers[f"L{i}.mla.state.latent"][: len(ids)]
        ref = torch.cat([cache.layers[i].keys[0, 0], cache.layers[i].values[0, 0]], dim=-1)  # [c | k_pe]
        torch.testing.assert_close(rows, ref, rtol=1e-5, atol=1e-5)


def test_batched_decode_equals_single(mini):
    """Sequence slots: a batched decode step per iteration equals each sequence's single-sequence decode
    (tests/runtime/batch_check.py)."""
    from tests.runtime import batch_check as BC

    BC.assert_batched(mini["moe"], VOCAB)
