"""Object stores selected by URL: file:// (default), s3://, hf://buckets/...

``open_store(url)`` looks the scheme up in a name-to-implementation registry
whose entries are imported lazily; an unknown scheme is an error that lists
the known ones.
"""
