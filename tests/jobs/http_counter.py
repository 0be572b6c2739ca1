"""An HTTP/1.1 server (keep-alive) on 127.0.0.1:PORT: each GET returns the number of GETs it has
answered so far, counted in memory.  Usage: http_counter.py PORT"""

import http.server
import sys


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # connections are kept open between requests
    count = 0

    def do_GET(self) -> None:
        Handler.count += 1
        body = b"%d\n" % Handler.count
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        print(Handler.count, flush=True)

    def log_message(self, *args) -> None:
        pass


server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
server.allow_reuse_address = True
print("listening", flush=True)
server.serve_forever()
