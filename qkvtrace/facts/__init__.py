"""Facts: pure functions of tensors and PyTorch's own answers -- paths and backends, PyTorch's refusals,
Q/K/V slices and the rows derived from a call's own functions, masks, maps, routes, health. They import the
records they fill and the ground floor, nothing of capture or above."""
