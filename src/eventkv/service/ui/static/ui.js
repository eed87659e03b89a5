// eventkv inspector: what htmx leaves to the page. Every fragment request carries the tab's bearer token and
// namespace; writes go to the JSON routes as JSON; an error answer's message is shown; a write that succeeded
// reloads what shows the memory.
(function () {
  "use strict";
  const KEY = "eventkv-token";
  const body = document.body;
  const status = () => document.getElementById("status");

  function say(text, error) {
    const el = status();
    if (!el) return;
    el.textContent = text;
    el.className = error ? "status error" : "status";
  }

  function askToken(message) {
    const box = document.getElementById("token-box");
    if (!box) return;
    box.hidden = false;
    document.getElementById("token-message").textContent = message || "";
    document.getElementById("token").focus();
  }

  document.addEventListener("htmx:configRequest", function (evt) {
    const token = sessionStorage.getItem(KEY);
    if (!token && body.dataset.tokens === "1") {
      evt.preventDefault(); // nothing to ask before the token form is answered: the fragments load on token-set
      return;
    }
    if (token) evt.detail.headers["Authorization"] = "Bearer " + token;
    evt.detail.headers["X-EventKV-Namespace"] = body.dataset.ns;
  });

  // the answers of the service's routes are JSON {code, message}: the message is what a person reads
  document.addEventListener("htmx:responseError", function (evt) {
    const xhr = evt.detail.xhr;
    let message = "request failed: HTTP " + xhr.status;
    try {
      const doc = JSON.parse(xhr.responseText);
      if (doc && doc.message) message = doc.message + " (HTTP " + xhr.status + " " + doc.code + ")";
    } catch (e) { /* not JSON: keep the status line */ }
    if (xhr.status === 401) {
      sessionStorage.removeItem(KEY);
      askToken(message);
    }
    // a fragment the server refused: its place says why, instead of "loading..."
    const target = evt.detail.target;
    if (evt.detail.requestConfig && evt.detail.requestConfig.verb === "get" && target) {
      const p = document.createElement("p");
      p.className = "muted";
      p.textContent = "not shown: " + message;
      target.replaceChildren(p);
    }
    say(message, true);
  });

  document.addEventListener("htmx:sendError", function () {
    say("the server cannot be reached: is eventkv serve still running?", true);
  });

  document.addEventListener("htmx:afterRequest", function (evt) {
    const elt = evt.detail.elt;
    if (!evt.detail.successful || !elt.closest("[data-write]")) return;
    let version = "";
    try { version = " — the memory is at version " + JSON.parse(evt.detail.xhr.responseText).version; } catch (e) { /* */ }
    say((elt.closest("[data-write]").dataset.write || "saved") + version, false);
    htmx.trigger(body, "memory-changed");
  });

  // the timeline form keeps the page shown (#timeline-page, set by each timeline fragment), so a write or a
  // query reloads that page; a new filter starts again at the first page (capture: before htmx reads the form)
  function firstPage(evt) {
    const page = document.getElementById("timeline-page");
    if (page && evt.target && (evt.target.id === "filter" || evt.target.id === "served_only")) page.value = "1";
  }
  document.addEventListener("input", firstPage, true);
  document.addEventListener("change", firstPage, true);

  // JSON bodies for the write routes: the form's text fields as strings (empty ones left out), the fields named
  // in data-list split at commas, the values of data-json with their JSON types, and with data-wrap the fields
  // wrapped in a one-item list under that key (POST .../events takes {"events": [...]}).
  htmx.defineExtension("json-body", {
    onEvent: function (name, evt) {
      if (name === "htmx:configRequest") evt.detail.headers["Content-Type"] = "application/json";
    },
    encodeParameters: function (xhr, parameters, elt) {
      xhr.overrideMimeType("text/json");
      const holder = elt.closest("[data-json]") || elt;
      const lists = (holder.dataset.list || "").split(",").filter(Boolean);
      const fields = {};
      parameters.forEach(function (value, key) {
        if (typeof value !== "string" || value.trim() === "") return;
        fields[key] = lists.includes(key) ? value.split(",").map((s) => s.trim()).filter(Boolean) : value;
      });
      const typed = JSON.parse(holder.dataset.json || "{}");
      const wrap = holder.dataset.wrap;
      return JSON.stringify(wrap ? Object.assign({ [wrap]: [fields] }, typed) : Object.assign(fields, typed));
    },
  });

  document.addEventListener("DOMContentLoaded", function () {
    const form = document.getElementById("token-form");
    if (form) {
      form.addEventListener("submit", function (evt) {
        evt.preventDefault();
        const value = document.getElementById("token").value.trim();
        if (!value) return;
        sessionStorage.setItem(KEY, value);
        document.getElementById("token-box").hidden = true;
        say("token kept for this tab", false);
        htmx.trigger(body, "token-set");
      });
    }
    if (body.dataset.tokens === "1" && !sessionStorage.getItem(KEY)) askToken("this server asks for a bearer token");
  });
})();
