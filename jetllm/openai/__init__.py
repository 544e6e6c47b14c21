"""OpenAI's API as jetllm speaks it: request bodies to jobs, and jobs' frames or stored results
back to OpenAI's response bodies, with OpenAI's typed errors naming the parameter.

The one home of that translation, shared by the gateway's endpoints and the batch runner (whose
output lines answer what the gateway would). Pure: it imports neither the HTTP stack nor vLLM,
so `jetllm batch` and the runner work without the `gateway` extra.
"""
