"""Analysis: measure a model and its routing, offline or through the Engine.

- trace, trace_stats, trace_plots: routing traces, their statistics and plots;
- predictor_eval: expert predictors scored on a trace;
- perplexity, verify: quality and the routing hook's end-to-end checks;
- report: text reports of model info, VRAM plans and trace statistics.
"""
