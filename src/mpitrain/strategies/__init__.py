"""Training strategies: data parallel, pipeline (model/hybrid), pipe-sgd. Each exposes make_trainer."""

__all__: list[str] = []
