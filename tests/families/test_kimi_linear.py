"""kimi_linear: KDA + NoPE MLA stacks against transformers 5.24's KimiLinearForCausalLM at the numerical
floor (dense and MoE FFNs), state providers that refuse what they cannot hold, the decode step replayed
natively, and the KDA state against the reference's cache. The lowering is checked in
tests/frontends/test_kimi_linear.py.
"""

from __future__ import annotations

import pytest
import torch

from tests import references as R
from tests.families import latent_support as S
from tests.families.kimi_linear_support import KDA_LAYERS, MLA_LAYERS, PROMPT, SPLIT, VOCAB
from tests.families.kimi_linear_support import mini  # noqa: F401  (fixture)


# ---------------------------------------------------------------- providers


def test_rows_only_provider_refuses_kda_layers(mini):
    from vxc.passes.findings import Refusal
    from vxc.runtime.state import ROWS_ONLY

    with pytest.raises(Refusal) as e:
        S.engine(mini["dense"], provider=ROWS_ONLY)
    refused = {(f.layer, f.operator) for f in e.value.findings}
    assert {(i, "kda") for i in KDA_LAYERS} <= refused
    kda = next(f for f in e.value.findings if f.operator == "kda")
    assert kda.code == "unsupported-region" and "delta (recurrent)" in kda.message and "conv_q (conv_history)" in kda.message


def test_provider_without_latent_rows_refuses_mla_layers(mini):
    from vxc.passes.findings import Refusal
    from vxc.runtime.state import StateProvider

    no_latent = StateProvider(kinds=("recurrent", "conv_history", "kv_rows"), name="no-latent")
    with pytest.raises(Refusal) as e:
        S.engine(mini["dense"], provider=no_latent)
    assert [(f.layer, f.operator) for f in e.value.findings] == [(i, "mla") for i in MLA_LAYERS]
    assert all("latent (latent_rows)" in f.message for f in e.value.findings)


# ---------------------------------------------------------------- parity at the floor


def test_parity_dense(mini):
    ids = S.prompt(VOCAB, PROMPT, seed=1)
    S.check_parity(*S.parity("kimi_linear (dense FFN)", mini["dense"], VOCAB, ids, SPLIT), PROMPT)


def test_parity_moe(mini):
    ids = S.prompt(VOCAB, PROMPT, seed=2)
    p, run, want = S.parity("kimi_linear (MoE)", mini["moe"], VOCAB, ids, SPLIT, moe=True)
    S.check_parity(p, run, want, PROMPT)
    assert p.experts_match, "the selected experts differ from the reference's at some token"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.native
def test_decode_replays_natively_bit_identical_to_the_graph(mini, dtype):
    """KDA, MLA (absorbed, on the latent rows), the grouped sigmoid router and the experts have native one-token
    forms: the decode step is captured and replayed, bit-identical to the graph."""
    S.assert_replay_bit_identical(mini["moe"], S.prompt(VOCAB, 20, seed=3), S.prompt(VOCAB, 12, seed=4), dtype)


def test_kda_state_matches_reference_cache(mini):
    """After a prefill, vxc's declared regions hold what transformers' cache holds (matrix and conv histories)."""
    import transformers

    ids = S.prompt(VOCAB, 37, seed=3)
    caches = {}
    for dt in (torch.float32, torch.float64):  # the floor of each state tensor: the reference's fp32 vs its fp64
        model = transformers.AutoModelForCausalLM.from_pretrained(str(mini["dense"]), dtype=torch.float32).to(dt).eval()
        with torch.no_grad():
            caches[dt] = model(torch.tensor([ids]), use_cache=True).cache
    from vxc.runtime.session import Session

    eng = S.engine(mini["dense"])
    Session(eng).prefill(ids)
    for i in KDA_LAYERS:
        st = lambda r: eng.state.buffers[f"L{i}.kda.state.{r}"]  # noqa: E731
        c32, c64 = caches[torch.float32].layers[i], caches[torch.float64].layers[i]
        R.assert_kernel_at_floor(st("delta"), c32.recurrent_states[0].float()[0], c64.recurrent_states[0][0],
                                 f"layer {i} delta state")
        # [3·24, k]: q | k | v channels, the raw projections
        R.assert_kernel_at_floor(torch.cat([st("conv_q"), st("conv_k"), st("conv_v")]), c32.conv_states[0][0],
                                 c64.conv_states[0][0], f"layer {i} conv histories")


def test_batched_decode_equals_single(mini):
    """Sequence slots: a batched decode step per iteration equals each sequence's single-sequence decode
    (tests/runtime/batch_check.py)."""
    from tests.runtime import batch_check as BC

    BC.assert_batched(mini["moe"], VOCAB)
