"""The step kernel (``StepEngine``) and what crosses its parts: the attempt's values, the ports
it hands its parts, the replica group, options, the step buffer, the optimizer step, the data
plane's communicators, requests between replicas, the job's errors."""
