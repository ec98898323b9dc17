"""Neuron SDK stand-ins, the neuron-cpu pytest plugin and the pre-sharding entry points."""
