"""Flax NNX, Flax Linen and Equinox models in leanstep's step: small adapters, one per framework.

Each turns a model written the framework's usual way into leanstep's three pieces, the
parameters (trained, cast to the compute dtype), the model state (batch statistics, counters,
a model's own RNG state: threaded through the microbatches, never trained, never cast) and a
loss function of them, and back again after training:

.. code-block:: text

    framework   split                                   loss
    NNX         nnx.split(model, nnx.Param, ...)        loss(graphdef, fn): fn(model, batch[, key])
    Linen       variables["params"], the rest           apply(module, params, model_state, *args)
    Equinox     eqx.partition(model, is_inexact_array)  loss(static, fn), stateful_loss(static, fn)

For the update inside the backward pass each also makes a :class:`leanstep.LayerStack` of a model
whose layers are one stacked module: ``linen.layer_stack`` (an ``nn.scan``), ``nnx.layer_stack``
(made with ``nnx.vmap``), ``equinox.layer_stack`` (made with ``eqx.filter_vmap``).

The modules import their framework; leanstep itself does not depend on any of them.
"""
