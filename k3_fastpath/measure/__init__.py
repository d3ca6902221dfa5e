"""What measures a decode step, beside ``runtime/`` (which serves it): the HBM floor (``floor.py``) and the
routing model it counts touched experts with (``routing.py``), per-layer-type section timing of a captured
step (``section_timing.py``), the CUPTI kernel profile of graph replays (``kernel_profile.py``), one TP rank
emulated on one GPU (``rank_emulation.py``), and seeded synthetic weights drawn on the GPU
(``device_synthetic.py``). Nothing in ``runtime/`` imports this package."""
