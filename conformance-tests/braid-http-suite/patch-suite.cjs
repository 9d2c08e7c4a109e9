#!/usr/bin/env node
// Makes the harness's patched copies of braid-http's test/test.js and
// test/tests.js, beside the originals (so their relative requires --
// '../braid-http-server.js', '../index.js', ... -- resolve unchanged):
//
//   test/harness-test.js   <- test/test.js
//   test/harness-tests.js  <- test/tests.js
//
// Only transport / URL plumbing is changed, never test logic. Every
// replacement states how many times it must match, so a change upstream
// makes this script fail loudly instead of silently patching less.
//
// usage: node patch-suite.js /path/to/braid-http-checkout

var fs = require('fs')
var path = require('path')

var root = process.argv[2]
if (!root) { console.error('usage: patch-suite.js BRAID_HTTP_DIR'); process.exit(2) }
var test_dir = path.join(root, 'test')

function patch (src, edits, label) {
    for (var [from, to, count] of edits) {
        var n = src.split(from).length - 1
        if (n !== count) {
            console.error(`patch-suite: ${label}: expected ${count} match(es) of ${JSON.stringify(from)}, found ${n}`)
            process.exit(1)
        }
        src = src.split(from).join(to)
    }
    return src
}

// ---------------------------------------------------------------- test.js

// A plain-TCP server that speaks both HTTP/1.1 and h2c (HTTP/2 with prior
// knowledge) on one port, the cleartext stand-in for the original
// http2.createSecureServer({allowHTTP1: true}) -- node's cleartext
// http2.createServer cannot fall back to HTTP/1.1. It peeks at the first
// bytes: the HTTP/2 connection preface goes to an http2 server, anything
// else to an http/1.1 server; both run the same request handler.
var h1_h2c_server = `
// [harness] cleartext HTTP/1.1 + h2c (prior knowledge) on one port; stands
// in for http2.createSecureServer({allowHTTP1: true}). TLS options are ignored.
function harness_h1_h2c_server (options, handler) {
    var h1 = require('http').createServer(handler)
    var h2 = require('http2').createServer(handler)
    var preface = Buffer.from('PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n')
    var sockets = new Set()
    var server = require('net').createServer(socket => {
        sockets.add(socket)
        socket.on('close', () => sockets.delete(socket))
        socket.on('error', () => {})
        var seen = Buffer.alloc(0)
        var sniff = () => {
            var chunk
            while ((chunk = socket.read()) !== null) seen = Buffer.concat([seen, chunk])
            var n = Math.min(seen.length, preface.length)
            var is_h2 = seen.subarray(0, n).equals(preface.subarray(0, n))
            if (is_h2 && seen.length < preface.length) return  // undecided: wait for more
            socket.removeListener('readable', sniff)
            socket.unshift(seen)
            ;(is_h2 ? h2 : h1).emit('connection', socket)
        }
        socket.on('readable', sniff)
    })
    server.closeAllConnections = () => {
        for (var s of sockets) s.destroy()
    }
    return server
}
`

var server_port_line = `
// [harness] the servers listen on HARNESS_SERVER_PORT..+4 (default: the
// client-facing port itself, i.e. no proxy); clients keep using port..+4,
// where the harness puts a proxy in front of each server
var server_port = parseInt(process.env.HARNESS_SERVER_PORT || port)
`

var test_js = fs.readFileSync(path.join(test_dir, 'test.js'), 'utf8')
test_js = patch(test_js, [
    // load the URL-patched copy of the test definitions
    ["require('./tests.js')", "require('./harness-tests.js')", 1],

    // server-side https.get (used by tests' /eval code) -> plain http.
    // Object.create: braidify_http mutates the module it is given; keep
    // node's shared http module untouched
    ["var https = http(require('https'))   // node's https module, braidified",
     "var https = http(Object.create(require('http')))   // [harness] node's http module (was https), braidified\n" + h1_h2c_server, 1],

    // TLS servers -> cleartext servers
    ["require('http2').createSecureServer(", "harness_h1_h2c_server(", 2],
    ["https.createServer(", "require('http').createServer(", 3],

    // where the servers listen
    ["    || 9000)\n", "    || 9000)\n" + server_port_line, 1],
    ["main_server.listen(port, 'localhost'",       "main_server.listen(server_port, 'localhost'", 2],
    ["express_server.listen(port + 1, 'localhost'", "express_server.listen(server_port + 1, 'localhost'", 2],
    ["wrapper_server.listen(port + 2, 'localhost'", "wrapper_server.listen(server_port + 2, 'localhost'", 2],
    ["wrapped_server.listen(port + 3, 'localhost'", "wrapped_server.listen(server_port + 3, 'localhost'", 2],
    ["no_mux_server.listen(port + 4, 'localhost'",  "no_mux_server.listen(server_port + 4, 'localhost'", 2],

    // clients' URLs
    ["https://localhost:", "http://localhost:", 8],

    // the rerun hint should name the harness copy
    ["rerun_command: 'node test/test.js'", "rerun_command: 'node test/harness-test.js'", 1],
], 'test.js')
fs.writeFileSync(path.join(test_dir, 'harness-test.js'), test_js)

// --------------------------------------------------------------- tests.js

var tests_js = fs.readFileSync(path.join(test_dir, 'tests.js'), 'utf8')
tests_js = patch(tests_js, [
    // the servers' URLs (the comment on line 11 included); 'https://x',
    // used only as a base for new URL(...).pathname, is left alone
    ["https://localhost:", "http://localhost:", 15],
], 'tests.js')
fs.writeFileSync(path.join(test_dir, 'harness-tests.js'), tests_js)

console.log('patch-suite: wrote test/harness-test.js and test/harness-tests.js')
