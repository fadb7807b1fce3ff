"""The zoo: every sparse MoE block the installed Hugging Face transformers can build, and the
routers of MoE training frameworks (Megatron-Core, DeepSpeed, fairscale, torchtitan), audited.

    from moe.audit.zoo import audit_frameworks, audit_zoo, zoo_markdown
    rows = audit_zoo(families=["mixtral", "switch_transformers"])   # default: every family
    rows += audit_frameworks(libraries=["deepspeed"])                # default: every framework
    print(zoo_markdown(rows))

``moe-audit --zoo`` runs the whole zoo. :mod:`moe.audit.zoo.build` finds and builds the blocks,
:mod:`moe.audit.zoo.frameworks` builds the framework routers, :mod:`moe.audit.zoo.run` audits
them and writes the table. transformers (``pip install -e '.[zoo]'``) and the frameworks
(``.[zoo-frameworks]``, installed with ``--no-deps``) are optional, imported lazily by these
modules only.
"""

from moe.audit.zoo.build import Built, ZooEntry, build, discover
from moe.audit.zoo.frameworks import FRAMEWORKS, FrameworkConfig
from moe.audit.zoo.run import (
    ZooRow,
    audit_entry,
    audit_framework,
    audit_frameworks,
    audit_zoo,
    run_zoo,
    zoo_json,
    zoo_markdown,
)

__all__ = [
    "FRAMEWORKS",
    "Built",
    "FrameworkConfig",
    "ZooEntry",
    "ZooRow",
    "audit_entry",
    "audit_framework",
    "audit_frameworks",
    "audit_zoo",
    "build",
    "discover",
    "run_zoo",
    "zoo_json",
    "zoo_markdown",
]
