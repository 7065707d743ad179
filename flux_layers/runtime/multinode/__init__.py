"""The multi-node wing of the fused operators: transfer plans for groups of several nodes (`transfer_plan`), the
NCCL transports of the all-gather and the reduce-scatter (`nccl_transport`, `nccl_rs_transport`), and the send/recv
primitive both run on (`sendrecv`: torch.distributed's, or a host-staged stand-in for ranks sharing one GPU)."""
