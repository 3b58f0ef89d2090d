"""The stability lab: the learning-rate sweep over residual schemes and its report."""
