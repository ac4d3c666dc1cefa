"""Communicators: one torch.distributed world per worker, joined once, and a pool of groups
cached by rank set (see `rendezvous` and `pool`). Import the submodules explicitly; this
package import pulls in nothing heavy.
"""
