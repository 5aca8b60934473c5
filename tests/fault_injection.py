"""Failures injected into distmon's own code, for the tests that prove none reaches training.

`FailureInjector` makes chosen places of distmon raise `InjectedFailure` while armed: every
public function of `distmon.step.sums` wherever a distmon module holds it (one site per holder:
``"distmon.sources.ddp.sq_sums"``, ``"distmon.step.activations.sq_sums"`` ...), torch's fused norm
kernels when called from distmon code (``"torch._foreach_powsum"``, ``"torch._foreach_norm"``),
and any further ``(owner, attribute)`` given (a method of a distmon class, a function a distmon
module imported): site ``"Owner.attribute"`` (``"BackwardSums.add_local"``) or, for a module,
``"module.attribute"``. ``active`` arms every site (True), none (False) or the sites named.
"""

import collections
import importlib
import inspect
import sys

import torch
from ddp_harness import distmon_dir, in_distmon_code


class InjectedFailure(RuntimeError):
    pass


class FailureInjector:
    """Make distmon code raise while armed; ``raised`` counts the failures, ``fired`` them per site.

    Example (in a rank, around the steps to fail)::

        inj = FailureInjector([(BackwardSums, "add_local")])
        inj.install()
        inj.active = {"BackwardSums.add_local"}   # or True: every site
        ...
        inj.uninstall()
    """

    def __init__(self, extra=()):
        self.active = False
        self.raised = 0
        self.fired = collections.Counter()
        self.patched = []  # the site names
        self._extra = list(extra)
        self._undo = []

    def armed(self, site):
        return self.active is True or (bool(self.active) and site in self.active)

    def _raiser(self, orig, site, gated):
        inj = self

        def fail(*args, **kwargs):
            if inj.armed(site) and (not gated or in_distmon_code(sys._getframe(1), inj.dm_dir)):
                inj.raised += 1
                inj.fired[site] += 1
                raise InjectedFailure(f"injected failure in distmon code ({site})")
            return orig(*args, **kwargs)

        return fail

    def _patch(self, owner, attr, site, gated=False):
        orig = vars(owner)[attr]
        self._undo.append((owner, attr, orig))
        setattr(owner, attr, self._raiser(getattr(owner, attr), site, gated))
        self.patched.append(site)

    def install(self):
        self.dm_dir = distmon_dir()
        sums = importlib.import_module("distmon.step.sums")
        public = {
            id(obj)
            for name, obj in vars(sums).items()
            if inspect.isfunction(obj) and obj.__module__ == sums.__name__ and not name.startswith("_")
        }
        for modname, mod in list(sys.modules.items()):
            if mod is None or not (modname == "distmon" or modname.startswith("distmon.")):
                continue
            for attr, val in list(vars(mod).items()):
                if id(val) in public:
                    self._patch(mod, attr, f"{modname}.{attr}")
        for name in ("_foreach_powsum", "_foreach_norm"):
            if getattr(torch, name, None) is not None:
                self._patch(torch, name, f"torch.{name}", gated=True)
        for owner, attr in self._extra:
            self._patch(owner, attr, f"{getattr(owner, '__name__', owner)}.{attr}")

    def uninstall(self):
        for owner, attr, orig in reversed(self._undo):
            setattr(owner, attr, orig)
        self._undo.clear()
