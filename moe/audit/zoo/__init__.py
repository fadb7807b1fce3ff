"""The zoo: every sparse MoE block the installed Hugging Face transformers can build, audited.

    from moe.audit.zoo import audit_zoo, zoo_markdown
    rows = audit_zoo(families=["mixtral", "switch_transformers"])   # default: every family
    print(zoo_markdown(rows))

``moe-audit --zoo`` runs the whole zoo. :mod:`moe.audit.zoo.build` finds and builds the blocks,
:mod:`moe.audit.zoo.run` audits them and writes the table. transformers is an optional extra
(``pip install -e '.[zoo]'``), imported lazily by these modules only.
"""

from moe.audit.zoo.build import Built, ZooEntry, build, discover
from moe.audit.zoo.run import ZooRow, audit_entry, audit_zoo, run_zoo, zoo_json, zoo_markdown

__all__ = ["Built", "ZooEntry", "ZooRow", "audit_entry", "audit_zoo", "build", "discover", "run_zoo", "zoo_json", "zoo_markdown"]
