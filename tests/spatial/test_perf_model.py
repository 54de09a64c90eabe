"""The §V-A cost model (mpitrain.perf.spatial) in one process: halo terms, overlap, mesh model shapes."""

from __future__ import annotations

from mpitrain.perf.spatial import ConvShape, conv_shapes, halo_messages, layer_cost, predict
from mpitrain.spatial.mesh import mesh_model

SHAPE = ConvShape(n=2, c=16, h=64, w=48, f=32, k=3)


def test_halo_messages_follow_the_paper_and_vanish_along_unsplit_dimensions():
    assert halo_messages(SHAPE, (1, 1), 1) == []
    assert halo_messages(SHAPE, (2, 1), 1) == [(2, 1 * 2 * 16 * 48 * 4)]  # north/south rows of I_W
    assert halo_messages(SHAPE, (1, 2), 1) == [(2, 1 * 2 * 16 * 64 * 4)]  # east/west columns of I_H
    assert halo_messages(SHAPE, (2, 2), 1) == [(2, 2 * 16 * 32 * 4), (2, 2 * 16 * 24 * 4), (4, 2 * 16 * 4)]
    assert halo_messages(ConvShape(1, 4, 8, 8, 4, 1), (2, 2), 1) == []  # 1x1 kernel: O = 0


def test_overlap_hides_halo_time_behind_compute_and_never_costs_more():
    compute = (1e-3, 2e-3, 2e-3)
    slow_net = dict(alpha=1e-4, beta=1e-9)
    hidden = layer_cost(SHAPE, (2, 2), 1, compute, overlap=True, **slow_net)
    exposed = layer_cost(SHAPE, (2, 2), 1, compute, overlap=False, **slow_net)
    assert hidden.total < exposed.total
    free = layer_cost(SHAPE, (1, 1), 1, compute, alpha=0.0, beta=0.0)
    assert free.total == sum(compute)


def test_mesh_model_shapes_and_spatial_prediction_scales_with_the_block():
    shapes = conv_shapes(mesh_model(), (1, 18, 256, 256))
    assert len(shapes) == 19 and shapes[0] == ConvShape(1, 18, 256, 256, 32, 3, 2)
    assert shapes[-1].k == 1 and shapes[-1].h == 4

    def volume(s):  # compute proportional to the local block
        n, c, h, w = s.local(grid, 1)
        t = n * c * h * w * s.f * 1e-10
        return t, t, t

    grid = (1, 1)
    one = predict(shapes, grid, 1, volume, 0.0, 0.0)
    grid = (2, 1)
    two = predict(shapes, grid, 1, volume, 0.0, 0.0)
    assert 0.45 < two / one < 0.6  # half the rows, rounded up on odd sizes
