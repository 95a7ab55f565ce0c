"""Selection: the resolution order, its memo, ``explain`` records and the runtime-fault policy.

Resolution order for one call (first that applies wins):

1. ``impl=`` argument of the call (strict);
2. ``with use_impl(...)`` scope, innermost first (strict when it names an op, else a preference);
3. env ``POLYKERNEL_IMPL_<OP>`` (strict), then env ``POLYKERNEL_IMPL`` (a preference list);
4. ``set_impl(...)`` (strict when it names an op, else a preference);
5. a tuned (measured) decision, when tuning holds one for this key;
6. auto: the lowest rank among the runnable impls (a spec's ``rank_for`` may set the rank of
   one argument class, from measurements; ``explain`` shows why), never one ranked behind the
   torch impl (those run by name or by measurement);
7. at run time, an impl chosen by 4-6 that raises falls back to the next runnable one (up to the
   torch impl, as in 6).

Strict means: unknown for the op, or not runnable here, raises :class:`ImplNotAvailableError`.
A preference skips ops that lack the impl (logged once); ``POLYKERNEL_STRICT=1`` makes that skip,
and every runtime fallback, an error. Environment variables are read when a decision is made
for a new key; after changing them in-process, call :func:`clear_caches`.

The package, one job a module (each imports only those above it in this list):
``state`` (settings, fault marks, strict mode), ``names`` (impl names as given),
``subclasses`` (tensor-subclass and inference-tensor calls), ``verdicts`` (each impl's
standing for an argument class), ``resolution`` (the order, the memoized :class:`Decision`, the
record of decisions and the fault policy), ``settings`` (the public controls), ``explain``
(introspection).
"""

# Besides the public names, some private ones that other modules and tests read here (the lines marked F401):
# the objects themselves, as state is mutated in place and never rebound. A test that patches a
# function patches it where it lives (``resolution._resolve``): a patch here would not be seen.
from .explain import Explanation, available_impls, decisions, explain
from .names import _parse_names  # noqa: F401
from .resolution import Decision, _record, decide, record_route  # noqa: F401
from .settings import clear_caches, clear_memos, forced_for, get_impl_settings, restore_impl_settings, set_impl, use_impl
from .state import SCOPE, _broken, _logged, generation, log_once, routed, strict_mode  # noqa: F401
from .subclasses import INFERENCE, saves_inference_tensor, subclass_name
from .verdicts import Verdict, _load, _why_not  # noqa: F401

__all__ = [
    "INFERENCE",
    "SCOPE",
    "Decision",
    "Explanation",
    "Verdict",
    "available_impls",
    "clear_caches",
    "clear_memos",
    "decide",
    "decisions",
    "explain",
    "forced_for",
    "get_impl_settings",
    "log_once",
    "record_route",
    "restore_impl_settings",
    "routed",
    "saves_inference_tensor",
    "set_impl",
    "strict_mode",
    "subclass_name",
    "use_impl",
]
