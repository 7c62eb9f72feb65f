"""A Flower app whose training rounds are aggregated by clipd with differential privacy."""
