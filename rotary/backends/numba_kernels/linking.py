"""Helpers compiled for linking only: LLVM IR that kernels link in, no machine code of their own.

Numba compiles every jitted function to machine code, helpers included, although a helper called only
from other jitted functions is never run from its own machine code: each caller links a copy of the
helper's (optimised) LLVM IR into its own module, and that module is what runs. Generating the helper's
machine code as well was ~15-25 % of a kernel's first call (apply_qk: its rotate_token helper alone
was compiled to machine code twice, once on its own and once inside the kernel).

:data:`HELPER_PIPELINE` (the ``pipeline_class`` of the kernels' helpers and overload implementations)
is Numba's own nopython pipeline with one pass added before lowering, which gives the function a
:class:`LinkOnlyLibrary`: optimised and linkable as every library is, but never handed to the JIT
engine. Its on-disk cache entry holds the IR (Numba's "bitcode" kind), turned into machine code only
if a later process loads it. The kernels themselves keep Numba's default pipeline: their machine
code is unchanged, bit for bit.
"""

from __future__ import annotations

from numba.core import codegen
from numba.core.compiler import CompilerBase, DefaultPassBuilder
from numba.core.compiler_machinery import AnalysisPass, register_pass
from numba.core.typed_passes import AnnotateTypes


class LinkOnlyLibrary(codegen.JITCodeLibrary):
    """A code library that is optimised and linked into its callers' libraries, never compiled to machine
    code itself (no entry point is taken from it: the helpers have no Python or C wrapper)."""

    def _finalize_final_module(self):
        # what Numba's version does, less the JIT engine's machine code (add_module + finalize_object)
        self._finalize_dynamic_globals()
        self._verify_declare_only_symbols()
        self._finalized = True

    def get_pointer_to_function(self, name):
        self._ensure_finalized()
        return 0    # no machine code: as for a function without a wrapper, there is no address to give

    @property
    def codegen(self):
        return _NoEnvironmentCodegen(self._codegen)

    def serialize_using_object_code(self):
        # the cache entry holds the IR (Numba reloads it as a normal library, compiled when loaded)
        return self.serialize_using_bitcode()


class _NoEnvironmentCodegen:
    """The codegen of a :class:`LinkOnlyLibrary` as Numba's lowering sees it: ``set_env`` (which writes the
    address of the function's environment into its global variable in the JIT engine) does nothing, there
    being no such variable in the engine. A helper's environment serves Python objects (boxing, dynamic
    exception messages), which no helper of these kernels uses."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def set_env(self, env_name, env):
        pass


@register_pass(mutates_CFG=False, analysis_only=True)
class UseLinkOnlyLibrary(AnalysisPass):
    """Gives the function being compiled a :class:`LinkOnlyLibrary` (lowering then fills it)."""

    _name = "rotary_use_link_only_library"

    def __init__(self):
        AnalysisPass.__init__(self)

    def run_pass(self, state):
        if state.library is None:
            state.library = LinkOnlyLibrary(state.targetctx.codegen(), state.func_id.func_qualname)
        return False


class HelperCompiler(CompilerBase):
    """Numba's nopython pipeline, the function's library link-only (:class:`UseLinkOnlyLibrary` before lowering)."""

    def define_pipelines(self):
        pm = DefaultPassBuilder.define_nopython_pipeline(self.state)
        pm.add_pass_after(UseLinkOnlyLibrary, AnnotateTypes)
        pm.finalize()
        return [pm]


def supported() -> bool:
    """Whether this Numba's code library has the steps :class:`LinkOnlyLibrary` relies on (0.59 to 0.68 do);
    where it does not, the helpers compile as Numba's default pipeline does (machine code included)."""
    needed = ("_finalize_final_module", "_finalize_dynamic_globals", "_verify_declare_only_symbols",
              "_ensure_finalized", "serialize_using_bitcode", "serialize_using_object_code")
    return all(callable(getattr(codegen.JITCodeLibrary, name, None)) for name in needed)


#: the ``pipeline_class`` jit option of the kernels' helpers (see the module docstring; None: Numba's default)
HELPER_PIPELINE = HelperCompiler if supported() else None
