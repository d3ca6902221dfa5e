"""What kind of value a record field holds, by its name: the one place ``bundle audit`` (how it compares a
field) and the audit's status rule (which disagreements may be informational) read it from.

* ``TIMING``: a timing (``*_us``, ``*_ms``, ``*_per_s``, ``pct_of_*``, ``speedup``, ``vs_*``, ``spread``,
  ``interactivity*``, a unit between underscores as in ``floor_us_by_layer_type``, ...); every field inside
  one is a timing too (``section_us.L3.mlp``);
* ``IGNORED``: wall-clock stamps and wall times, hosts, ports, a ``*_timer`` description that quotes its
  measured overhead: never compared.
"""

from __future__ import annotations

import re

TIMING = re.compile(r"(_us|_ms|_per_s|_per_gpu|_gbs|tb_per_s|_s)$|_(us|ms)_|^(pct_of|speedup|vs_|x_floor|spread|"
                    r"interactivity|times|samples|step_us|duration|window|throughput|read_bw|gb_per_s|tokens_per_s)")
IGNORED = re.compile(r"(_at|_ns|hostname.*|pid|log_path|port|base_url|url|wall_s|_timer|_samples)$|"
                     r"^(started|ended|elapsed|seconds$|timing_spread$)")


def is_timing_path(path: str) -> bool:
    """Whether the field at ``path`` (``per_layer_type_us.kda``, ``rows[3].step_us_p90``) is a timing: some key
    along it names one."""
    return any(TIMING.search(re.sub(r"\[\d+\]$", "", k)) for k in path.split(".") if k)
