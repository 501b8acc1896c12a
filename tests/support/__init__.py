"""Reusable test utilities: a real etcd server, two hosts in network namespaces."""
