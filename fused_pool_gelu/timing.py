"""Re-exports of fused_pool_gelu.measure for the importers not yet moved to it (tests/conftest.py,
benchmarks/floors.py, benchmarks/profile_forward.py, benchmarks/timer_state_case.py)."""

from .measure import capture_cuda_graph, l2_flush_buffer, make_timer  # noqa: F401
