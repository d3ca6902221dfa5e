"""Device-side helpers shared by the CuTe DSL kernels (not a kernel: no ``spec.py``, so the registry skips it).

* ``primitives.py``: scalar math (``sigmoid``) and the one global access a PDL build may make before
  ``griddepcontrol.wait``: ``prefetch_weights_l2``, named for what it may touch (weights, never anything a
  step writes). ``tests/test_pdl_compile.py`` checks the compiled PTX / SASS of every PDL build for any
  other global access before the wait, so the rule the name states is also verified.
* ``pdl.py``: ``PdlOrder``, through which every kernel waits (``griddepcontrol.wait``) and triggers its
  dependents, and which hands each operand back typed by when it may be touched: a weight as it is (it may
  be read before the wait), everything a step writes or whose addresses depend on it as an ``AfterWait``
  handle that fails the trace when touched before the wait (in both builds, so on a CPU compile too).
* ``ptx.py``: inline-PTX building blocks of the tensor-core kernels (cp.async, ldmatrix, mma.sync BF16,
  shared-memory vectors, e4m3 -> BF16).

Importing this package imports cutlass-dsl: only kernel modules (``kernel*.py``) import it.
"""
