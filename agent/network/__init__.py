"""A job's sockets: a running job's, asked of the sockets themselves (netstate), an epoch's, read from criu's
images (criuimages), a vacated job's connections held for its restart (netlock), and whether criu carries sockets here
(netprobe).

May import pipeline and processes."""
