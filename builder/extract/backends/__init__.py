"""Where forward passes happen. A backend takes requests (a sample's token ids) and hands back states; the
worker's loop is the same for every backend (see base.Backend). `inprocess`: a model this process loads;
`vllm`: a running vLLM server whose states arrive as files in a staging folder."""
