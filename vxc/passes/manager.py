"""The pass manager: a textual pipeline of named passes, MLIR-style
instrumentation (print-after NAME / all / failure), and the structural
verifier after every pass."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from ..ir.printer import print_module
from .bind import Bind
from .closure import Closure
from .context import Context
from .findings import Finding, Refusal
from .plan import Plan, print_plan
from .shard import ShardPass
from .state import State
from .verify import Verify, verify_structure


class Pass(Protocol):
    name: str

    def run(self, ctx: Context) -> list[Finding]: ...


PASSES: dict[str, Callable[[], Pass]] = {"verify": Verify, "bind": Bind, "closure": Closure, "state": State, "plan": Plan}
# passes that live in modules importing torch: loaded only when a pipeline names them
LATE = {"fuse": "vxc.codegen.passes", "codegen": "vxc.codegen.passes"}
ORDER = list(PASSES) + list(LATE)
LOWER_PIPELINE = "verify,bind,closure,state"
DEFAULT_PIPELINE = "verify,bind,closure,state,plan"
# tensor parallelism (Context.tp > 1): the plan of one rank's part. ``shard`` is known to parse_pipeline but is not
# in ORDER, so a pipeline extended by --print-after (and every TP=1 run) never includes it.
PASSES["shard"] = ShardPass
TP_PIPELINE = DEFAULT_PIPELINE + ",shard"


def register(name: str, factory: Callable[[], Pass]) -> None:
    """Later stages (fuse, codegen) add their passes here."""
    PASSES[name] = factory
    if name not in ORDER:
        ORDER.append(name)


def dump_header(name: str) -> str:
    return f"// -----// IR Dump After {name} //----- //"


def _load_late(name: str) -> None:
    if name in LATE and name not in PASSES:
        import importlib

        importlib.import_module(LATE[name])


def parse_pipeline(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError("empty pipeline")
    for n in names:
        _load_late(n)
    for n in names:
        if n not in PASSES:
            raise ValueError(f"unknown pass {n!r}; known passes: {', '.join(ORDER)}")
    return names


def print_pipeline(names: list[str]) -> str:
    return ",".join(names)


def dump(ctx: Context, name: str) -> str:
    """What --print-after shows for a pass: the IR text, or the artefact the pass made."""
    if name in ctx.artefacts and name != "plan":
        art = ctx.artefacts[name]
        body = art.listing() if hasattr(art, "listing") else str(art)
    elif name == "plan":
        body = print_plan(ctx.artefacts["plan"])
    elif name == "shard" and ctx.tp > 1:  # the rank's IR (operands annotated with their parts) and its plan
        body = print_module(ctx.module) + print_plan(ctx.artefacts["plan"])
    else:
        body = print_module(ctx.module)
    return f"{dump_header(name)}\n{body}"


@dataclass
class PassManager:
    pipeline: list[str]
    print_after: set[str] = field(default_factory=set)
    print_after_all: bool = False
    print_after_failure: bool = False
    verify_each: bool = True
    emit: Callable[[str], None] = print

    def run(self, ctx: Context) -> Context:
        for name in self.pipeline:
            findings = PASSES[name]().run(ctx)
            for f in findings:
                f.pass_name = f.pass_name or name
            if not findings and self.verify_each and name != "verify":
                findings = verify_structure(ctx.module)
                for f in findings:
                    f.pass_name = f"verify after {name}"
            if findings:
                if self.print_after_failure or self.print_after_all or name in self.print_after:
                    self.emit(dump(ctx, name).replace("IR Dump After", "IR Dump After Failure", 1))
                raise Refusal(findings[0].pass_name, findings)
            if self.print_after_all or name in self.print_after:
                self.emit(dump(ctx, name))
        return ctx
