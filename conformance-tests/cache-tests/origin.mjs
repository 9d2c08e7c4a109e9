// Starts the http-cache-tests origin server (server/server.mjs of the npm
// package) on loopback only. The package's server reads its port from
// npm_config_port and calls server.listen(port), i.e. on every interface;
// this wrapper makes every listen() in this process bind 127.0.0.1 instead.
// Port 0 picks a free port; the server prints
// "Listening on http://127.0.0.1:PORT/" once it is up.
//
// env: npm_config_port (default 0), npm_config_pidfile (where the package
// writes its pid; default a file in the OS temp dir).

import fs from 'node:fs'
import http from 'node:http'
import os from 'node:os'
import path from 'node:path'
import process from 'node:process'

process.env.npm_config_protocol = 'http'
process.env.npm_config_port = process.env.npm_config_port || '0'
process.env.npm_config_pidfile = process.env.npm_config_pidfile ||
  path.join(os.tmpdir(), `http-cache-tests-origin-${process.pid}.pid`)

// The package writes the pidfile and never removes it; do that here.
const pidfile = process.env.npm_config_pidfile
process.on('exit', () => { try { fs.unlinkSync(pidfile) } catch {} })
for (const signal of ['SIGINT', 'SIGTERM']) process.on(signal, () => process.exit(0))

const listen = http.Server.prototype.listen
http.Server.prototype.listen = function (port, ...rest) {
  const callback = rest.find(arg => typeof arg === 'function')
  return callback
    ? listen.call(this, Number(port), '127.0.0.1', callback)
    : listen.call(this, Number(port), '127.0.0.1')
}

// One resource served the way a Braid server serves it, outside the
// suite's own paths: run.mjs asks the proxy for it before the suite (a
// plain GET and a subscription), so that the run shows that a proxy which
// has served a Braid answer still caches plain resources (issue 37: one
// Braid header once switched the whole process to pass-through).
const BRAID_PATH = '/__braid/doc'
function serveBraid (req, res) {
  const headers = { 'content-type': 'text/plain', version: '"b1"', parents: '"b0"' }
  if (/^(true|\?1|)$/i.test(req.headers.subscribe ?? 'no')) {
    res.writeHead(209, { ...headers, subscribe: 'true', 'cache-control': 'no-store' })
    res.write('Version: "b1"\r\nContent-Length: 5\r\n\r\nbraid\r\n\r\n')
    const beat = setInterval(() => res.write('\r\n'), 1000)
    res.on('close', () => clearInterval(beat))
    return
  }
  res.writeHead(200, { ...headers, 'cache-control': 'max-age=60', 'content-length': '5' })
  res.end('braid')
}
const createServer = http.createServer
http.createServer = function (...args) {
  return createServer.apply(this, args.map(arg => typeof arg !== 'function'
    ? arg
    : (req, res) => req.url === BRAID_PATH ? serveBraid(req, res) : arg(req, res)))
}

await import('http-cache-tests/server/server.mjs')
